"""forktool: fetch, materialise, export, check and build the chunk-cache fork of vLLM.

Run it through the `./fork` launcher at the repository root; `./fork --help` lists the commands.
"""
