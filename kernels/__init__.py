"""Ops with one signature and a torch reference (`naive.py`, any device, exact math) beside any
GPU implementation. One op a folder: `kda/`, `conv/`, `mla/`, `moe/`, `mxfp4/`, `norm/`, `attn_res/`, `linear/`,
`gate/`, `embedding/`, `head_matmul/`."""
