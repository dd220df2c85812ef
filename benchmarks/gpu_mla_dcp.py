"""One DCP rank's MLA decode against the unsplit decode, on one GPU: the local part and the merge.

    python benchmarks/gpu_mla_dcp.py [--out gpu_mla_dcp.json] [--smoke]

Per shape (N sequences of ctx tokens, K3 at TP 8: H = 8 heads a rank, L 512 + R 64, pages of 64, bf16):
  unsplit = `mla_decode_paged` of a TP rank without DCP: its H heads over all ctx tokens;
  local   = the same kernel on DCP rank 0 of W (the fullest: earlier ranks fill first): the group's W*H heads
            (the queries all-gathered) over its ctx / W tokens (`kernels/mla/dcp.py` `local_seq_lens`);
  merge   = `merge_attn_states` of the W ranks' partial outputs for this rank's H heads, [W, N, H, L] fp32;
  dcp     = local + merge; vs_unsplit = unsplit / dcp (> 1: DCP's attention is faster). Every timing is a one-call
  CUDA graph after an L2 flush (`graph_us`). The two collectives a layer (all-gather of q, all-to-all of o + lse)
  are not in it: they need ranks on several GPUs (the cross-GPU run, a separate issue); `collective_bytes` is what
  they move a rank and layer, for that run's floor.
Floors = the bytes each reads / copy bandwidth. Before timing, the split + merge of all W ranks is checked against
the unsplit decode over the same W*H heads (`mla_decode_dcp`, Triton on CUDA) and the fp32 reference at the smaller
contexts. --smoke: tiny shapes on the CPU, the kernels through the Triton interpreter (fp16)."""

from __future__ import annotations

import json
import sys

import torch

from _gpu_common import (ceilings, check, device, device_name, floor_us, graph_us, parse_args, print_table, rel_err,
                         use_triton_interpreter, x_floor)
from k3serve.kernels.mla import dcp, mla_decode_dcp, naive

L, R, PAGE, H = 512, 64, 64, 8
SCALE = 192**-0.5
TOL = 1e-2
CHECK_REFERENCE_MAX_CTX = 32768  # the fp32 reference gathers every token: above this it only costs time


class DcpCase:
    """N sequences of ctx tokens in a cache of virtual blocks [blocks, W * PAGE, L+R] (shuffled): DCP rank r's
    tensor is page r of each (a contiguous copy), the unsplit decode reads the same bytes as blocks of PAGE."""

    def __init__(self, N: int, ctx: int, W: int, dev: torch.device, dtype: torch.dtype) -> None:
        span = W * PAGE
        per_seq = -(-ctx // span)
        num_blocks = N * per_seq + 3
        self.W, self.N, self.ctx = W, N, ctx
        self.kv = torch.randn(num_blocks, span, L + R, device=dev, dtype=dtype)
        self.tables = torch.randperm(num_blocks, device=dev)[: N * per_seq].reshape(N, per_seq).int()
        self.lens = torch.full((N,), ctx, device=dev, dtype=torch.int32)
        pages = (self.tables.long()[:, :, None] * W + torch.arange(W, device=dev)).flatten(1)  # [N, per_seq * W]
        self.page_kv, self.page_tables = self.kv.view(num_blocks * W, PAGE, L + R), pages.int()
        self.shard0 = dcp.shard_cache(self.kv, W)[0].contiguous()
        self.local_lens = dcp.local_seq_lens(self.lens, PAGE, W, 0)
        self.q_tp = torch.randn(N, H, L, device=dev, dtype=dtype), torch.randn(N, H, R, device=dev, dtype=dtype)
        self.q_group = (torch.randn(N, W * H, L, device=dev, dtype=dtype),
                        torch.randn(N, W * H, R, device=dev, dtype=dtype))
        self.parts = torch.randn(W, N, H, L, device=dev), torch.randn(W, N, H, device=dev)

    def unsplit(self, q=None):
        from k3serve.kernels.mla import triton_decode

        q_latent, q_pe = q or self.q_tp
        return triton_decode.mla_decode_paged(q_latent, q_pe, self.page_kv, self.page_tables, self.lens, SCALE,
                                              self.ctx)

    def local(self):
        from k3serve.kernels.mla import triton_decode

        q_latent, q_pe = self.q_group
        return triton_decode.mla_decode_paged(q_latent, q_pe, self.shard0, self.tables, self.local_lens, SCALE,
                                              int(self.local_lens.max()))

    def merge(self):
        from k3serve.kernels.mla import triton_decode

        return triton_decode.merge_attn_states(*self.parts)

    def check(self) -> float:
        """Split + merge of every rank == the unsplit decode over the group's heads (and the fp32 reference)."""
        q_latent, q_pe = self.q_group
        o, lse = mla_decode_dcp(q_latent, q_pe, self.kv, self.tables, self.lens, SCALE, L, self.W)
        ref_o, ref_lse = self.unsplit(self.q_group)
        if self.ctx <= CHECK_REFERENCE_MAX_CTX:
            ref_o, ref_lse = naive.mla_decode_paged(q_latent, q_pe, self.page_kv, self.page_tables, self.lens,
                                                    SCALE, L)
        return max(rel_err(ref_o, o), (lse - ref_lse).abs().max().item())

    def bytes(self) -> dict[str, int]:
        """What each reads and writes: the unsplit and local decodes their KV rows, queries and outputs, the merge
        its fp32 parts and output; the collectives' bytes a rank sends (q in fp32, o + lse in fp32)."""
        row = (L + R) * 2
        local_tokens = int(self.local_lens.sum())
        return dict(unsplit=self.N * self.ctx * row + self.N * H * (row + L * 2 + 4),
                    local=local_tokens * row + self.N * self.W * H * (row + L * 2 + 4),
                    merge=self.W * self.N * H * (L + 1) * 4 + self.N * H * (L * 4 + 4),
                    collective=(self.W - 1) * self.N * H * ((L + R) * 4 + (L + 1) * 4))


def row(N: int, ctx: int, W: int, dev, ceil, dtype) -> dict:
    case = DcpCase(N, ctx, W, dev, dtype)
    err = case.check()
    check(f"dcp N{N} ctx{ctx} W{W}", err, TOL)
    moved = case.bytes()
    unsplit, local, merge = graph_us(case.unsplit, dev), graph_us(case.local, dev), graph_us(case.merge, dev)
    total = None if None in (local, merge) else local + merge
    floors = {name: floor_us(moved[name], 0, ceil) for name in ("unsplit", "local", "merge")}
    context = f"{ctx // 1024}K" if ctx >= 1024 else str(ctx)
    return dict(shape=f"N{N} ctx{context} W{W}", unsplit=unsplit, local=local, merge=merge, dcp=total,
                vs_unsplit="-" if None in (unsplit, total) else f"{unsplit / total:.2f}",
                unsplit_floor=floors["unsplit"], local_floor=floors["local"], merge_floor=floors["merge"],
                local_x_floor=x_floor(local, floors["local"]), collective_bytes=moved["collective"],
                err=f"{err:.1e}")


def main() -> None:
    args = parse_args(__doc__)
    dev = device(args.smoke)
    if dev.type == "cpu":
        use_triton_interpreter()
    torch.manual_seed(0)
    ceil = ceilings(dev, args.smoke)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16
    if args.smoke:
        shapes = [(1, 300, 2), (2, 500, 4)]
    else:
        shapes = [(N, ctx, W) for ctx in (32768, 65536, 131072) for N in (1, 16) for W in (2, 4, 8)]
    result = {"device": device_name(dev), "ceilings": ceil, "rows": []}
    for N, ctx, W in shapes:
        result["rows"].append(row(N, ctx, W, dev, ceil, dtype))
        print(result["rows"][-1], file=sys.stderr, flush=True)
        if args.out is not None:  # after every row: a time limit that cuts the run keeps what was measured
            args.out.write_text(json.dumps(result, indent=1))
    columns = ["shape", "unsplit", "local", "merge", "dcp", "vs_unsplit", "unsplit_floor", "local_floor",
               "merge_floor", "local_x_floor", "collective_bytes", "err"]
    print_table(f"MLA decode, one DCP rank vs a TP rank (us in a one-call graph; H {H} a rank, pages of {PAGE})",
                columns, result["rows"], ceil, dev)


if __name__ == "__main__":
    main()
