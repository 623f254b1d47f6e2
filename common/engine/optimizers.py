"""The critic's optimizer for the FSDP2 engines (fsdp, veomni): engine.optim.name and state_dtype.

  adamw, float32    torch's fused AdamW (what the engines always built)
  adamw, bfloat16   AdamW with its two moments stored in bf16 (half the state: 4 bytes a
                    parameter instead of 8): each step the fp32 step's arithmetic on the moments
                    widened, the moments rounded back. On CPU one pass (adamw_bf16.c, compiled
                    on first use; the same numbers, bit for bit, as the three-pass form it
                    replaces); on CUDA, or without a C compiler, three passes: the moments
                    upcast, torch's fused fp32 AdamW kernel, the moments rounded back
  muon, *           torch's Muon (momentum, Newton-Schulz orthogonalisation, lr matched to
                    AdamW's RMS: adjust_lr_fn="match_rms_adamw") on the backbone's 2-D hidden
                    matrices; AdamW (in state_dtype) on the rest: embeddings, norms, biases and
                    the value head (muon_parameters says which)

Parameters are FSDP2 DTensor shards. AdamW is elementwise, so it runs on each rank's shard. Muon's
orthogonalisation needs whole matrices: the matrices are shared out among the ranks of the shard group
(balanced by their Newton-Schulz cost), each matrix's rows go to its rank in one all-to-all, each rank
orthogonalises its own, and a second all-to-all brings every rank its rows of every result (Moonlight's
and Dion's distributed Muon). The numbers are those of orthogonalising every matrix on every rank.
The Newton-Schulz iteration and the lr adjustment are torch's own (torch.optim._muon), so a step
equals torch.optim.Muon + torch.optim.AdamW on the same parameter groups of an unsharded model.
"""

from __future__ import annotations


import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import _muon

from . import adamw_bf16
from .config import OptimConfig
from .transforms import trainable_parameters

HEAD_NAMES = ("score", "v_head", "value_head", "lm_head")  # a critic's head, by its module name
MUON_MOMENTUM, MUON_ADJUST_LR = 0.95, "match_rms_adamw"


def muon_parameters(model: torch.nn.Module) -> list[str]:
    """Names of the trainable parameters Muon steps: 2-D weights of the backbone's linear layers
    (not the embeddings, norms, biases or the value head, which AdamW steps)."""
    names = []
    for module_name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module_name.split(".")[-1] in HEAD_NAMES:
            continue
        weight = module.weight
        if weight.requires_grad and weight.ndim == 2:
            names.append(f"{module_name}.weight" if module_name else "weight")
    return names


def build_optimizer(model: torch.nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer engine.optim names over the model's trainable parameters (see the module docstring)."""
    if optim.name == "adamw" and optim.state_dtype == "float32":
        # fused: one kernel for all parameters instead of a dozen elementwise ops per parameter.
        return torch.optim.AdamW(trainable_parameters(model), lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                                 weight_decay=optim.weight_decay, fused=True)
    muon = set(muon_parameters(model)) if optim.name == "muon" else set()
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for name, p in named if name not in muon], "kind": "adamw"}]
    if muon:
        groups.append({"params": [p for name, p in named if name in muon], "kind": "muon"})
    return CriticOptimizer([g for g in groups if g["params"]], lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                           weight_decay=optim.weight_decay, state_dtype=getattr(torch, optim.state_dtype))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class CriticOptimizer(torch.optim.Optimizer):
    """AdamW and Muon parameter groups (group["kind"]), state in `state_dtype`, on DTensor shards."""

    def __init__(self, params, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 state_dtype: torch.dtype, momentum: float = MUON_MOMENTUM):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "momentum": momentum,
                    "kind": "adamw"}
        self.state_dtype = state_dtype
        super().__init__(params, defaults)
        on_cpu = any(_local(p).device.type == "cpu" for g in self.param_groups for p in g["params"])
        # bf16 moments on CPU: the one-pass kernel where it builds (its `why` says why not).
        if state_dtype == torch.bfloat16 and on_cpu:
            self.adamw_kernel = adamw_bf16.kernel()
        else:
            self.adamw_kernel = adamw_bf16.Kernel(None, f"{state_dtype} state" if on_cpu else "parameters not on CPU")
        for group in self.param_groups:
            if group["kind"] == "muon" and any(p.ndim != 2 for p in group["params"]):
                raise ValueError("Muon steps 2-D matrices only")

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "CriticOptimizer takes no closure"
        for group in self.param_groups:
            stepped = [p for p in group["params"] if p.grad is not None]
            if group["kind"] == "muon":
                self._muon_group(stepped, group)
            else:
                self._adamw_group(stepped, group)

    def _zeros(self, p: torch.Tensor) -> torch.Tensor:
        # A DTensor like the parameter (same mesh and placements): DCP saves it as one global tensor.
        return torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)

    def _adamw_group(self, params: list[torch.Tensor], group: dict) -> None:
        beta1, beta2 = group["betas"]
        hyper = dict(lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"])
        batch, scratch = [], {}  # the kernel's tensors; (device, dtype) -> the three-pass step's two buffers
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"], state["exp_avg_sq"] = self._zeros(p), self._zeros(p)
            state["step"] += 1  # the kernels read the step, as torch's AdamW increments it first
            tensors = param, grad, exp_avg, exp_avg_sq = (_local(p), _local(p.grad), _local(state["exp_avg"]),
                                                          _local(state["exp_avg_sq"]))
            if exp_avg.dtype == param.dtype:  # the state in the parameters' dtype: torch's kernel on it directly
                torch._fused_adamw_([param], [grad.to(param.dtype)], [exp_avg], [exp_avg_sq], [], [state["step"]],
                                    amsgrad=False, maximize=False, **hyper)
            elif self.adamw_kernel.step and adamw_bf16.applies(*tensors):
                batch.append((*tensors, state["step"].item()))
            else:
                adamw_bf16.three_pass_step(*tensors, state["step"], hyper, scratch)
        if batch:  # every tensor of the group in one call: one pass over memory (adamw_bf16.c)
            self.adamw_kernel.step(*map(list, zip(*batch)), **hyper)

    def _muon_group(self, params: list[torch.Tensor], group: dict) -> None:
        updates = [self._muon_update(p, group) for p in params]
        split = _row_split(params)
        if split is not None:  # each rank orthogonalises its share of the matrices
            orthos = _orthogonalise_shared(params, updates, *split)
        else:
            orthos = [_orthogonalise_whole(p, update) for p, update in zip(params, updates)]
        for p, ortho in zip(params, orthos):
            param = _local(p)
            param.mul_(1 - group["lr"] * group["weight_decay"])
            param.add_(ortho.to(param.dtype), alpha=-_muon._adjust_lr(group["lr"], MUON_ADJUST_LR, p.shape))

    def _muon_update(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """This rank's part of the matrix Muon orthogonalises: the Nesterov momentum update, fp32."""
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = self._zeros(p)
        momentum = group["momentum"]
        grad, buffer = _local(p.grad).float(), _local(state["momentum_buffer"])
        buf = buffer.float().lerp_(grad, 1 - momentum)
        buffer.copy_(buf)
        return grad.lerp(buf, momentum)  # Nesterov, as torch's Muon by default


def _newton_schulz(matrix: torch.Tensor) -> torch.Tensor:
    return _muon._zeropower_via_newtonschulz(matrix, (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C),
                                             _muon.DEFAULT_NS_STEPS, _muon.EPS)


def _orthogonalise_whole(p: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """Every rank orthogonalises the whole matrix (gathered) and keeps its own part."""
    if not isinstance(p, DTensor):
        return _newton_schulz(update)
    whole = DTensor.from_local(update, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    ortho = _newton_schulz(whole.full_tensor())
    return distribute_tensor(ortho, p.device_mesh, p.placements, src_data_rank=None).to_local()


def _row_split(params: list[torch.Tensor]):
    """(process group, its size, this rank's index) when every matrix is a DTensor split by rows over
    one mesh dimension of one mesh (replicated over the others: FSDP2 and HSDP) of 2+ ranks; None
    otherwise (those take the whole-matrix path). Decided from placements alone: the same on every rank."""
    if not params or not all(isinstance(p, DTensor) for p in params):
        return None
    mesh, placements = params[0].device_mesh, params[0].placements
    if any(p.device_mesh != mesh or p.placements != placements for p in params):
        return None
    shard_dims = [i for i, placement in enumerate(placements) if placement.is_shard()]
    if len(shard_dims) != 1 or placements[shard_dims[0]].dim != 0 or \
            not all(placement.is_replicate() for i, placement in enumerate(placements) if i != shard_dims[0]):
        return None
    dim = shard_dims[0]
    if mesh.size(dim) < 2:
        return None
    return mesh.get_group(dim), mesh.size(dim), mesh.get_local_rank(dim)


def _rows(total: int, ranks: int) -> list[int]:
    """Rows each rank holds of a matrix split by rows (torch.chunk's split: DTensor's Shard(0))."""
    chunk = -(-total // ranks)
    return [max(0, min(chunk, total - r * chunk)) for r in range(ranks)]


def share_matrices(shapes: list[tuple[int, int]], ranks: int) -> list[int]:
    """The rank that orthogonalises each matrix: largest first to the least-loaded rank, a matrix's
    cost its Newton-Schulz multiply-adds (rows x cols x min(rows, cols))."""
    load, owner = [0] * ranks, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: -shapes[i][0] * shapes[i][1] * min(shapes[i])):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += shapes[i][0] * shapes[i][1] * min(shapes[i])
    return owner


def _orthogonalise_shared(params, updates, group, ranks: int, me: int) -> list[torch.Tensor]:
    """Muon's orthogonalisation divided among the ranks of the row split: each matrix's rows go to the
    rank that owns it (one all-to-all), each rank orthogonalises its own matrices, and every rank gets
    its rows of every result back (a second all-to-all). The same numbers as _orthogonalise_whole."""
    import torch.distributed as dist

    shapes = [tuple(p.shape) for p in params]
    rows = [_rows(shape[0], ranks) for shape in shapes]
    owner = share_matrices(shapes, ranks)
    mine = [i for i in range(len(params)) if owner[i] == me]
    device = updates[0].device
    # 1. each rank's rows of every matrix to the matrix's owner
    send = [torch.cat([updates[i].reshape(-1) for i in range(len(params)) if owner[i] == dest] or
                      [torch.zeros(0, device=device)]) for dest in range(ranks)]
    receive = [sum(rows[i][src] * shapes[i][1] for i in mine) for src in range(ranks)]
    gathered = torch.empty(sum(receive), device=device)
    dist.all_to_all_single(gathered, torch.cat(send), receive, [t.numel() for t in send], group=group)
    pieces = {i: [] for i in mine}
    offset = 0
    for src in range(ranks):
        for i in mine:
            size = rows[i][src] * shapes[i][1]
            pieces[i].append(gathered[offset:offset + size].view(rows[i][src], shapes[i][1]))
            offset += size
    # 2. this rank's matrices, orthogonalised; every rank's rows of them back to it
    orthos = {i: _newton_schulz(torch.cat(pieces[i])).float() for i in mine}
    send = []
    for dest in range(ranks):
        parts = [orthos[i][sum(rows[i][:dest]):sum(rows[i][:dest + 1])].reshape(-1) for i in mine]
        send.append(torch.cat(parts) if parts else torch.zeros(0, device=device))
    receive = [sum(rows[i][me] * shapes[i][1] for i in range(len(params)) if owner[i] == src) for src in range(ranks)]
    scattered = torch.empty(sum(receive), device=device)
    dist.all_to_all_single(scattered, torch.cat(send), receive, [t.numel() for t in send], group=group)
    out, offsets = [None] * len(params), [sum(receive[:src]) for src in range(ranks)]
    for i in range(len(params)):  # in index order within each source: the order its owner sent them
        size = rows[i][me] * shapes[i][1]
        out[i] = scattered[offsets[owner[i]]:offsets[owner[i]] + size].view(rows[i][me], shapes[i][1])
        offsets[owner[i]] += size
    return out


def optimizer_line(optim: OptimConfig, optimizer=None) -> str:
    """The run's report of its optimizer: which steps what, the state's dtype, where it lives between
    steps (`optimizer`: the engine's, for the parameter counts of a CriticOptimizer's groups)."""
    counts = {}
    for group in getattr(optimizer, "param_groups", []):
        if "kind" in group:
            counts[group["kind"]] = counts.get(group["kind"], 0) + sum(p.numel() for p in group["params"])
    count = lambda kind: f" ({counts[kind]:,} parameters)" if kind in counts else ""  # noqa: E731
    if optim.name == "muon":
        what = (f"muon on the backbone's 2-D hidden matrices{count('muon')}, adamw on embeddings, norms, biases and "
                f"the value head{count('adamw')}")
    else:
        what = "adamw"
    where = "; in host memory between steps (engine.optim.offload_state)" if optim.offload_state else ""
    kernel = getattr(optimizer, "adamw_kernel", None)
    how = f"; adamw's bf16 step: {kernel}" if optim.state_dtype == "bfloat16" and kernel is not None else ""
    return f"optimizer: {what}; {optim.state_dtype} state{where}{how}"
