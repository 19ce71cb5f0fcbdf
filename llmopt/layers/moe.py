"""A sparse Mixture-of-Experts MLP block (Qwen3-MoE, Mixtral, Qwen2-MoE's shared expert).

Routing follows the Hugging Face reference. Three paths, the first that takes the block runs: where every
projection runs on our CPU kernels (bf16 packed, W8A16 or W4A16 on a CPU with AVX512-BF16 or AVX2, no hooks), the whole
block is one C call (`moe_native.py`), which the decode step calls as well; while every expert is a plain float
Linear pair (fp32, CUDA), their weights live in two stacked [experts, out, in] tensors (which the Linears view)
and run as two `grouped_mm` calls; otherwise one matmul per expert over its routed tokens. `calibrate_all` experts
(empty in serving) also see every token, for calibration statistics, without changing the block output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.layers import kernels
from llmopt.layers.activation import silu_and_mul
from llmopt.layers.kernels import Ops
from llmopt.layers.linear import FusedLinear
from llmopt.layers.moe_native import NativeMoe, native_moe

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class ExpertMLP(nn.Module):
    """SiLU-gated MLP with a fused gate|up projection (one expert, or the shared expert)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype, device):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = FusedLinear(hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size},
                                        bias=False, dtype=dtype, device=device)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, ops: Ops = Ops.EAGER) -> torch.Tensor:
        return self.down_proj(kernels.call(ops, silu_and_mul, self.gate_up_proj(x), self.intermediate_size))


class SparseMoeBlock(nn.Module):
    decode_lowering = "sparse_moe"  # how llmopt.step lowers it (read off this class only, not subclasses)

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 norm_topk_prob: bool, shared_expert_intermediate_size: int, dtype, device):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, dtype=dtype, device=device)
        self.experts = nn.ModuleList(ExpertMLP(hidden_size, intermediate_size, dtype, device)
                                     for _ in range(num_experts))
        if shared_expert_intermediate_size:
            self.shared_expert = ExpertMLP(hidden_size, shared_expert_intermediate_size, dtype, device)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False, dtype=dtype, device=device)
        else:
            self.shared_expert = None
        self.calibrate_all: frozenset[int] = frozenset()
        self.last_counts: torch.Tensor | None = None  # tokens per expert in the last forward
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None  # (gate_up [E, 2I, H], down [E, H, I])
        self._pack_state: tuple = ()
        self._grouped_broken = _GROUPED_MM is None
        self._native: NativeMoe | str = ""  # the C block's spec, or why there is none (see `native`)
        self._native_key: tuple = ()

    def native_modules(self) -> tuple[nn.Module, ...]:
        """The projections the C block reads, in its order: router, each expert's gate|up and down, then the
        shared expert's gate|up, down and gate."""
        mods = [self.gate, *(m for e in self.experts for m in (e.gate_up_proj, e.down_proj))]
        if self.shared_expert is not None:
            mods += [self.shared_expert.gate_up_proj, self.shared_expert.down_proj, self.shared_expert_gate]
        return tuple(mods)

    def native(self) -> NativeMoe | str:
        """The C block's spec, or why the block does not run there; read again when a projection was swapped
        or a hook added or removed (the spec keeps the tensors it points into alive)."""
        mods = self.native_modules()
        hooked = any(m._forward_hooks or m._forward_pre_hooks for m in mods)
        if self._native_key != (mods, hooked):
            self._native = "a projection has hooks" if hooked else native_moe(self, mods, gelu=False)
            self._native_key = (mods, hooked)
        return self._native

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k])."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def _still_packed(self) -> bool:
        """Cheap per-step check that every expert still runs the packed views, with no hooks on it."""
        for e, gu, dn, pgu, pdn, ptrs in self._pack_state:
            mods = e._modules
            if (mods["gate_up_proj"] is not gu or mods["down_proj"] is not dn or gu._forward_pre_hooks
                    or dn._forward_pre_hooks or gu._forward_hooks or dn._forward_hooks
                    or gu._parameters["weight"] is not pgu or dn._parameters["weight"] is not pdn
                    or (pgu.data_ptr(), pdn.data_ptr()) != ptrs):
                return False
        return True

    def _grouped_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stacked expert weights when the grouped path may run (packing them on first use), else None."""
        if self._grouped_broken or self.calibrate_all:
            return None
        if self._stacked is not None and self._still_packed():
            return self._stacked
        self._stacked = None
        for e in self.experts:
            for m in (e.gate_up_proj, e.down_proj):
                if (type(m) not in (FusedLinear, nn.Linear) or m.bias is not None or m.weight.is_meta
                        or m._forward_pre_hooks or m._forward_hooks):
                    return None
        with torch.no_grad():
            gate_up = torch.stack([e.gate_up_proj.weight.detach() for e in self.experts])
            down = torch.stack([e.down_proj.weight.detach() for e in self.experts])
        state = []
        for e, gu, dn in zip(self.experts, gate_up, down, strict=True):  # the Linears view the stacks
            pgu = e.gate_up_proj.weight = nn.Parameter(gu, requires_grad=False)
            pdn = e.down_proj.weight = nn.Parameter(dn, requires_grad=False)
            state.append((e, e.gate_up_proj, e.down_proj, pgu, pdn, (pgu.data_ptr(), pdn.data_ptr())))
        self._pack_state = tuple(state)
        self._stacked = (gate_up, down)
        return self._stacked

    def _grouped(self, x, slot_weights, order, counts) -> torch.Tensor | None:
        """All experts in two grouped matmuls; None where they cannot run (for good once refused here)."""
        stacked = self._grouped_weights()
        if stacked is None:
            return None
        gate_up, down = stacked
        tokens = order // self.top_k
        try:
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            h = _GROUPED_MM(x[tokens], gate_up.transpose(-2, -1), offs=offs)
            h = silu_and_mul(h, gate_up.shape[1] // 2)
            y = _GROUPED_MM(h, down.transpose(-2, -1), offs=offs)
        except (RuntimeError, NotImplementedError):  # e.g. CUDA grouped_mm wants bf16 on sm80+
            self._grouped_broken = True
            return None
        return torch.zeros_like(x).index_add_(0, tokens, y * slot_weights[order, None])

    def _looped(self, x, ops, slot_weights, order, counts: list[int]) -> torch.Tensor:
        """One matmul per expert over its routed tokens; `calibrate_all` experts run on every token."""
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0 and e not in self.calibrate_all:
                continue
            slots = order[start:start + n]
            start += n
            tokens = slots // self.top_k
            if e in self.calibrate_all:
                y = self.experts[e](x, ops)[tokens]
            else:
                y = self.experts[e](x[tokens], ops)
            out.index_add_(0, tokens, y * slot_weights[slots, None])
        return out

    def forward(self, x: torch.Tensor, ops: Ops = Ops.EAGER) -> torch.Tensor:
        if (not self.calibrate_all and x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2
                and isinstance(native := self.native(), NativeMoe)):
            out, self.last_counts = native(x.contiguous())
            return out
        weights, experts = self.route(x)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, k) slots grouped by expert
        self.last_counts = counts = torch.bincount(flat, minlength=self.num_experts)
        slot_weights = weights.reshape(-1)
        out = self._grouped(x, slot_weights, order, counts)
        if out is None:
            out = self._looped(x, ops, slot_weights, order, counts.tolist())
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, ops)
        return out
