# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The chunk cache's KV connector (engine glue of the position-independent
chunk KV cache); see connector.py."""
