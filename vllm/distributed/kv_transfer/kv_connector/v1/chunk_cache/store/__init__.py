# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fleet tier of the chunk cache: a byte store shared by every replica
(base.py: the seam; mooncake.py: the one backend on the data path)."""
