"""The decode step as one native call: `DecodeStep` runs every decoder layer of a bf16 CPU decode step
through `decode_step.c`, over a program lowered once from the model (`lowering.py`) and buffers allocated
once. Python prepares what the step reads (embedding, RoPE tables, the attention metadata the backend
built) and makes one call; nothing runs in Python per layer.

Output is bit for bit the eager step's: the same kernels on the same inputs (the eager path of a decode
step under `kernels.NATIVE_PREFILL_ROWS` rows runs these kernels one Python call at a time). Steps the program
does not take (prefill chunks, bigger batches, other dtypes or devices) run eagerly. An int8 / fp8 KV cache is
read by the same kernel on both paths, and written here by `paged_kv_quantize`, which stores the bytes the
eager path's torch code stores (a test compares them). A CUDA backend would be a capture of the same step
per batch-size bucket (docs/ARCHITECTURE.md, "The decode step").
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

import llmopt.native as native
from llmopt.layers import kernels, moe_native, native_ops
from llmopt.layers.attention import HeadMajorBackend, HeadMajorMetadata
from llmopt.layers.attention.paged_decode_kernel import load as load_attention
from llmopt.layers.kernels import Ops
from llmopt.layers.packed_linear import vnni_kernel
from llmopt.models.base import CausalLM
from llmopt.step.lowering import NotLowered, lower_model
from llmopt.step.program import OP_NAMES, OP_ROTARY

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_step.c")
# decode steps of more rows run TorchInductor's norms and SiLU·up, eagerly; under it the eager step runs the same
# native kernels as the program (kernels.native_below), so the two agree bit for bit up to here
MAX_ROWS = kernels.NATIVE_PREFILL_ROWS - 1
MAX_KV_GROUPS, MAX_ROPE_SETS = 4, 2  # decode_step.c's limits (checked against the library on load)
DG_FIELDS = 2 + 3 * MAX_KV_GROUPS


class Kernels(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("norm", "rotary", "act", "linear", "linear_amx", "linear_int4",
                                               "linear_int4_amx", "attend", "kv_quantize", "moe")]


class Step(ctypes.Structure):
    """decode_step.c's step_t: what one call reads besides its program."""

    _fields_ = [("rows", ctypes.c_int64), ("cos", ctypes.c_void_p * MAX_ROPE_SETS),
                ("sin", ctypes.c_void_p * MAX_ROPE_SETS), ("slots", ctypes.c_void_p * MAX_KV_GROUPS),
                ("num_decode_groups", ctypes.c_int64), ("decode_groups", ctypes.c_void_p), ("nthreads", ctypes.c_int),
                ("seconds", ctypes.c_void_p)]


class StepLibrary:
    """The loaded `decode_step.c` and the kernels it calls (their addresses, from their own libraries)."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.decode_step.argtypes = [ptr, ptr, i64, ptr, i64, ptr]  # kernels, ops, n, tail ops, n, step
        lib.decode_step.restype = ctypes.c_int64
        lib.decode_step_limits.restype = ctypes.c_int
        limits = [lib.decode_step_limits(i) for i in range(4)]
        if limits != [MAX_KV_GROUPS, MAX_ROPE_SETS, DG_FIELDS, len(OP_NAMES)]:
            raise OSError(f"decode_step.c limits {limits} differ from decode_step.py's")
        self.fn, self.path = lib.decode_step, path


def _kernels() -> Kernels | None:
    """The kernels' addresses, or None where one of them cannot run here (the MoE block's may be missing:
    then a MoE model is not lowered)."""
    ops, linear, attend, moe = native_ops.load(), vnni_kernel(), load_attention(), moe_native.load()
    if ops is None or linear is None or attend is None:
        return None
    return Kernels(**ops.addresses(), **linear.addresses(), attend=attend.address(),
                   kv_quantize=attend.quantize_address(), moe=moe.address() if moe is not None else None)


def max_rows(model: CausalLM) -> int:
    """The most rows of a decode step the program takes for `model`: MAX_ROWS, or where the layers normalize
    q and k per head, the most whose eager q/k norms (tokens x heads rows each, `kernels.Ops.COMPILED` from
    `kernels.MIN_TOKENS` tokens) still run the native norm the program's HEAD_NORM runs."""
    heads = max((layer.self_attn.num_heads for layer in model.layers
                 if getattr(getattr(layer, "self_attn", None), "qk_norm", False)), default=1)
    return min(MAX_ROWS, max(kernels.MIN_TOKENS - 1, MAX_ROWS // heads))


class DecodeStep:
    """A model's decode step over its KV cache; `takes(meta)` says whether a step runs here."""

    def __init__(self, model: CausalLM, cache, block_size: int, lib: StepLibrary, kernels_: Kernels):
        self.model, self.lib, self.kernels = model, lib, kernels_
        self.max_rows = max_rows(model)
        self.program, self.layer_ends = lower_model(model, cache, block_size, self.max_rows)
        self.body = self.program.array(0, self.layer_ends[-1])
        self.tail = self.program.array(self.layer_ends[-1])
        self._args = ctypes.addressof(self.kernels), ctypes.addressof(self.body), ctypes.addressof(self.tail)
        self.out = self.program.buffer("normed", model.spec.hidden_size).tensor
        self.residual = self.program.buffer("residual", model.spec.hidden_size).tensor
        self.num_kv_groups = getattr(cache, "num_groups", 1)
        self.head_dim = model.spec.head_dim
        self.rope_sets = 1 + max((op.i[0] for op in self.program.ops if op.kind == OP_ROTARY), default=0)
        self.step = Step()
        self.profile: ctypes.Array | None = None  # see `start_profile`

    def start_profile(self) -> None:
        """From now on, add each op kind's seconds to `op_seconds()` (a clock read per op: for profiles)."""
        self.profile = (ctypes.c_double * len(OP_NAMES))()
        self.step.seconds = ctypes.addressof(self.profile)

    def stop_profile(self) -> None:
        """Stop the clock reads (`op_seconds()` keeps what was added)."""
        self.step.seconds = None

    def op_seconds(self) -> dict[str, float]:
        """Seconds spent in each kind of op since `start_profile`."""
        return dict(zip(OP_NAMES, self.profile or [0.0] * len(OP_NAMES), strict=True))

    @classmethod
    def build(cls, model: CausalLM, cache, backend) -> DecodeStep | None:
        """The step for `model` over `cache`, or None (with the reason logged once) where it does not run:
        not a bf16 CPU model with our kernels, or a layer the lowering does not take."""
        reason = cls._refusal(model, cache, backend)
        if reason is None:
            lib = native.load(SOURCE, StepLibrary, "decode steps run layer by layer")
            kernels_ = _kernels() if lib is not None else None
            if lib is None or kernels_ is None:
                reason = "a kernel cannot be built here"
            else:
                try:
                    return cls(model, cache, backend.block_size, lib, kernels_)
                except NotLowered as e:
                    reason = str(e)
        log.info("decode steps run layer by layer (%s)", reason)
        return None

    @staticmethod
    def _refusal(model: CausalLM, cache, backend) -> str | None:
        p = next(model.parameters())
        if p.device.type != "cpu" or cache.dtype != torch.bfloat16 or p.dtype != torch.bfloat16:
            return "not a bf16 model on a CPU"
        if not isinstance(backend, HeadMajorBackend) or not backend.allow_compiled:
            return "eager mode or another attention backend"
        if getattr(cache, "num_groups", 1) > MAX_KV_GROUPS:
            return f"more than {MAX_KV_GROUPS} KV groups"
        return None

    def takes(self, meta) -> bool:
        """Whether this step's tokens are all decodes that the native kernels would run one by one."""
        return (isinstance(meta, HeadMajorMetadata) and meta.num_prefill_tokens == 0
                and meta.ops in (Ops.NATIVE, Ops.COMPILED) and bool(meta.decode_groups)
                and len(meta.slot_mapping) <= self.max_rows)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: HeadMajorMetadata,
                 num_layers: int | None = None) -> torch.Tensor:
        """Final hidden states [T, hidden] of a decode step; writes its K/V into the cache."""
        t = input_ids.shape[0]
        self.residual[:t].copy_(self.model.embed(input_ids))
        rope = self.model.rotary(positions)
        sets = rope if isinstance(rope[0], tuple) else (rope,)
        if len(sets) < self.rope_sets:
            raise RuntimeError(f"decode step: the program reads {self.rope_sets} RoPE tables, the model gave {len(sets)}")
        s = self.step
        s.rows, s.nthreads = t, torch.get_num_threads()
        for i, (cos, sin) in enumerate(sets):  # [T, 1, D] float32, contiguous: what the C code reads
            if not (cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
                    and cos.numel() == sin.numel() == t * self.head_dim):
                raise RuntimeError(f"decode step: RoPE tables {cos.dtype} {tuple(cos.shape)}, not [{t}, 1, "
                                   f"{self.head_dim}] float32")
            s.cos[i], s.sin[i] = cos.data_ptr(), sin.data_ptr()
        for g in range(self.num_kv_groups):
            s.slots[g] = meta.slot_mappings[g].data_ptr()
        rows = []
        for group in meta.decode_groups:
            row = [group.size, group.lens.data_ptr()] + [0] * (3 * MAX_KV_GROUPS)
            for g in range(self.num_kv_groups):
                row[2 + 3 * g:5 + 3 * g] = group.blocks[g].data_ptr(), group.blocks[g].shape[1], group.starts[g]
            rows.append(row)
        groups = torch.tensor(rows, dtype=torch.int64)
        s.num_decode_groups, s.decode_groups = len(rows), groups.data_ptr()
        n = len(self.body) if num_layers is None else self.layer_ends[num_layers - 1]
        k, body, tail = self._args
        rc = self.lib.fn(k, body, n, tail, len(self.tail), ctypes.addressof(s))
        if rc:
            raise RuntimeError(f"decode step: op {(rc & 0xFFFF) - 1} failed (kernel code {rc >> 16})")
        return self.out[:t].clone()
