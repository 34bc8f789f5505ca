"""Exercise 18: expert parallelism, a mixture of experts whose tokens travel by all-to-all.

    python moe.py --ep 2 --capacity-factor 1   # 2 ranks, 2 experts each, every token to its top 2; full experts drop
    python moe.py --dp 2 --ep 2                # 4 ranks: two copies of the experts, each split over 2 ranks

A mixture-of-experts layer holds many experts (small MLPs) and a router. The router scores every
expert for every token, and each token goes through its k best experts only: the model has many
experts' parameters, a token pays for k. With expert parallelism the experts live on different
ranks, so the tokens travel to their experts and back, by all-to-all, in numbers that no rank
knows in advance: the router decides them as the batch runs.

Every rank holds its own tokens (its rows of the batch: data parallel). The ep ranks of an
expert-parallel group hold the experts between them, each `per_rank` of them, expert e on the
group's rank e // per_rank; the router and the other layers are on every rank. With dp > 1 there
are dp such groups, each with all the experts, and the ranks that hold the same experts form a
data-parallel group. One layer's forward is: route, count, exchange the counts, send the tokens,
run the local experts, send the outputs back, combine. Its backward is the same exchanges in
reverse: autograd runs them from the AllToAll function you write.

Rank 0 also trains the same model alone, every expert in one process, on every rank's rows, and
prints both losses. Handout: exercises/18_moe.md.
"""

import importlib.util
import math
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course.device import current_device, synchronize
from course.flags import whole
from course.launch import launch, launch_options
from mlp import ModelConfig, batches, config_from, gen_dataset, make_parser, split_dataset

# --- Routing: which experts each token goes to, and how much each counts ---------------------------


def route(logits: torch.Tensor, k: int) -> tuple:
    """The router's choice for each token, from its scores `logits` [tokens, experts].

    probs: the softmax of each token's scores over all the experts. Each token's k experts are
    those of its k largest probabilities, largest first, and their weights are those
    probabilities as they are (not renormalized over the k: with k = 1 a token's weight still
    tells the router how sure it was, as the Switch Transformer has it). Returns (weights
    [tokens, k], experts [tokens, k] of int64, probs [tokens, experts]).
    """
    # TODO(exercise 18): the softmax over the experts, then each token's k largest.
    ### BEGIN SOLUTION
    probs = logits.softmax(dim=-1)
    weights, experts = probs.topk(k, dim=-1)
    return weights, experts, probs
    ### END SOLUTION


def balance_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The Switch Transformer's load-balancing loss of one batch: n * sum over experts e of
    f_e * P_e, where n is the number of experts (probs' columns), f_e the fraction of the batch's
    choices (tokens x k) that went to expert e, and P_e the mean over the tokens of probs[:, e].
    It is 1 when the load is even and the router as sure of every expert; its gradient reaches the
    router through P only (f is a count).
    """
    # TODO(exercise 18): f from the choices (a count, no gradient), P from probs.
    ### BEGIN SOLUTION
    n = probs.shape[-1]
    f = torch.bincount(experts.reshape(-1), minlength=n).to(probs.dtype) / experts.numel()
    return n * (f * probs.mean(dim=0)).sum()
    ### END SOLUTION


def capacity(tokens: int, k: int, n_experts: int, factor: float | None) -> int | None:
    """How many of a rank's choices each expert takes: factor times an even share of them (rounded up);
    None for no limit."""
    return None if factor is None else math.ceil(factor * tokens * k / n_experts)


def within_capacity(experts: torch.Tensor, n_experts: int, limit: int | None) -> torch.Tensor:
    """Which of this rank's choices `experts` [tokens, k] are kept: a bool tensor of its shape.

    Each expert takes at most `limit` of them (every one where limit is None), the first ones in
    token order (token 0's choices before token 1's, a token's first choice before its second);
    the others are dropped. The limit is per expert, never per rank.
    """
    if limit is None:
        return torch.ones_like(experts, dtype=torch.bool)
    # TODO(exercise 18): each choice's place among the choices of its expert before it, kept below the limit.
    ### BEGIN SOLUTION
    chosen = F.one_hot(experts.reshape(-1), n_experts)
    place = (chosen.cumsum(dim=0) * chosen).sum(dim=-1) - 1
    return (place < limit).view_as(experts)
    ### END SOLUTION


# --- Communication: the counts first, then the tokens, both ways -------------------------------------


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """counts[e]: how many tokens this rank sends to expert e, for every expert of the group (expert
    e on the group's rank e // per_rank). Returns [group size, per_rank]: row s, how many tokens the
    group's rank s sends to each expert of this rank, learnt from the group's ranks (an all-to-all
    does it in one call); no rank guesses them.
    """
    # TODO(exercise 18): every rank learns what it will receive, before any token travels.
    ### BEGIN SOLUTION
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    return received.view(dist.get_world_size(group), -1)
    ### END SOLUTION


class AllToAll(torch.autograd.Function):
    """forward: x's rows, in blocks of send_sizes[r] rows, block r to the group's rank r; returns
    the rows received, recv_sizes[s] from the group's rank s, in its ranks' order. backward: the
    gradient goes back the way the rows came, the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send_sizes: list, recv_sizes: list, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.sizes, ctx.group = (send_sizes, recv_sizes), group
        # TODO(exercise 18): one all_to_all_single with uneven splits, into a tensor of the rows received.
        ### BEGIN SOLUTION
        received = x.new_empty((sum(recv_sizes), *x.shape[1:]))
        dist.all_to_all_single(received, x.contiguous(), recv_sizes, send_sizes, group=group)
        return received
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        send_sizes, recv_sizes = ctx.sizes
        # TODO(exercise 18): the gradient of x: each row's gradient back to the rank it came from.
        ### BEGIN SOLUTION
        sent_back = grad.new_empty((sum(send_sizes), *grad.shape[1:]))
        dist.all_to_all_single(sent_back, grad.contiguous(), send_sizes, recv_sizes, group=ctx.group)
        return sent_back, None, None, None
        ### END SOLUTION


# --- The layer: dispatch, the local experts, combine ----------------------------------------------


@dataclass
class Dispatched:
    """What a dispatch sent, for its combine: `tokens`, the token of each row sent, in the order sent;
    `weights`, each such row's router weight; `sent`, how many rows went to each rank of the group;
    `received`, exchange_counts' answer (rows from each rank, for each expert of this rank)."""

    tokens: torch.Tensor
    weights: torch.Tensor
    sent: list
    received: torch.Tensor


def dispatch(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, keep: torch.Tensor, n_experts: int, group):
    """Send each kept choice's token (its row of x) to its expert's rank: returns (the rows this rank
    received, in the order AllToAll gives them; the Dispatched that combine needs).

    The rows leave sorted by expert, ties in token order, so that the block for each rank holds its
    experts' rows one expert after the other. The counts are exchanged first (exchange_counts),
    then the rows (AllToAll), both in `group`.
    """
    # TODO(exercise 18): the kept choices' tokens and weights sorted by expert, the counts, then the rows.
    ### BEGIN SOLUTION
    kept = keep.reshape(-1)
    tokens = torch.arange(len(x), device=x.device).repeat_interleave(experts.shape[-1])[kept]
    chosen = experts.reshape(-1)[kept]
    order = torch.argsort(chosen, stable=True)
    counts = torch.bincount(chosen, minlength=n_experts)
    received = exchange_counts(counts, group)
    sent = counts.view(dist.get_world_size(group), -1).sum(dim=1).tolist()
    arrived = AllToAll.apply(x[tokens[order]], sent, received.sum(dim=1).tolist(), group)
    return arrived, Dispatched(tokens[order], weights.reshape(-1)[kept][order], sent, received)
    ### END SOLUTION


def run_experts(local: nn.ModuleList, arrived: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
    """Each received row through its expert. `received` [group size, per_rank] says how the rows came:
    first rank 0's block, received[0, 0] rows for this rank's first expert, then received[0, 1] for
    its second, ...; then rank 1's block, and so on. Returns the outputs in the rows' order."""
    # TODO(exercise 18): the rows in their (rank, expert) blocks, each block through its expert.
    ### BEGIN SOLUTION
    blocks = arrived.split(received.reshape(-1).tolist())
    return torch.cat([local[i % len(local)](block) for i, block in enumerate(blocks)])
    ### END SOLUTION


def combine(x: torch.Tensor, out: torch.Tensor, sent: Dispatched, group) -> torch.Tensor:
    """The experts' outputs back to the ranks their tokens came from (the reverse AllToAll), each
    weighted by its router weight and added to its token's row of x: returns x plus, for each token,
    the weighted sum of its kept choices' outputs. A token whose choices were all dropped passes
    through unchanged."""
    # TODO(exercise 18): the reverse exchange, then each output row weighted and added to its token.
    ### BEGIN SOLUTION
    back = AllToAll.apply(out, sent.received.sum(dim=1).tolist(), sent.sent, group)
    return x.index_add(0, sent.tokens, back * sent.weights.unsqueeze(-1))
    ### END SOLUTION


def expert(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))


class MoE(nn.Module):
    """A mixture-of-experts layer over `group`, from its router and all its experts, which every rank
    built the same: this rank keeps the router and its own experts, numbers group rank * per_rank
    and on. forward(x) routes x's rows (route, within_capacity), sends them (dispatch), runs them
    (run_experts) and combines them (combine); it keeps the batch's balance loss in self.aux and
    what it did in self.stats."""

    def __init__(self, router: nn.Linear, experts: list, k: int, capacity_factor: float | None, group) -> None:
        super().__init__()
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if len(experts) % size:
            raise ValueError(f"{len(experts)} experts do not divide over the {size} ranks of an expert-parallel group")
        per_rank = len(experts) // size
        self.router, self.local = router, nn.ModuleList(experts[rank * per_rank : (rank + 1) * per_rank])
        self.n_experts, self.k, self.capacity_factor, self.group = len(experts), k, capacity_factor, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts, probs = route(self.router(x), self.k)
        self.aux = balance_loss(probs, experts)
        keep = within_capacity(experts, self.n_experts, capacity(len(x), self.k, self.n_experts, self.capacity_factor))
        arrived, sent = dispatch(x, weights, experts, keep, self.n_experts, self.group)
        y = combine(x, run_experts(self.local, arrived, sent.received), sent, self.group)
        self.stats = {"received": sent.received.sum(dim=0), "dropped": int((~keep).sum()), "sent": sent.sent}
        return y


def mixture_alone(router: nn.Linear, experts: list, k: int, capacity_factor: float | None, x: torch.Tensor) -> tuple:
    """The same layer in one process, every expert here and nothing sent: (its output, the balance loss)."""
    weights, chosen, probs = route(router(x), k)
    keep = within_capacity(chosen, len(experts), capacity(len(x), k, len(experts), capacity_factor))
    y = x
    for e, net in enumerate(experts):
        tokens, which = ((chosen == e) & keep).nonzero(as_tuple=True)
        y = y.index_add(0, tokens, net(x[tokens]) * weights[tokens, which].unsqueeze(-1))
    return y, balance_loss(probs, chosen)


# --- Expert and data parallel together ----------------------------------------------------------


@dataclass
class ExpertMesh:
    """The world's dp * ep ranks in dp rows of ep: a row is an expert-parallel group (ep_group), which
    holds every expert between its ranks; a column is a data-parallel group (dp_group), the ranks
    that hold the same experts."""

    dp: int
    ep: int
    ep_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup


def expert_mesh(dp: int, ep: int) -> ExpertMesh:
    if dp * ep != dist.get_world_size():
        raise ValueError(f"a mesh of dp {dp} x ep {ep} needs {dp * ep} ranks, the world has {dist.get_world_size()}")
    rows = [list(range(i * ep, (i + 1) * ep)) for i in range(dp)]
    ep_group, _ = dist.new_subgroups_by_enumeration(rows)
    dp_group, _ = dist.new_subgroups_by_enumeration([list(column) for column in zip(*rows)])
    return ExpertMesh(dp, ep, ep_group, dp_group)


class MoEModel(nn.Module):
    """Exercise 1's classifier with a mixture of experts in the middle: a dense layer, tanh, the MoE
    layer, tanh, a dense layer to the classes."""

    def __init__(self, config: ModelConfig, n_experts: int) -> None:
        super().__init__()
        width = config.d_hidden
        self.embed, self.head = nn.Linear(config.d_in, width), nn.Linear(width, config.n_classes)
        self.router, self.experts = nn.Linear(width, n_experts), nn.ModuleList(expert(width) for _ in range(n_experts))

    def forward(self, x: torch.Tensor, mixture) -> torch.Tensor:
        return self.head(torch.tanh(mixture(torch.tanh(self.embed(x)))))


def sync_gradients(model: nn.Module, local_experts: nn.Module, mesh: ExpertMesh) -> None:
    """After each rank's backward of its own loss: leave every gradient that of the mean over the
    world's ranks of their losses. The parameters on every rank (all but the experts) average their
    gradients over the world. An expert's gradient already sums what every rank of its ep group sent
    it (AllToAll's backward brought their gradients back to it): it is summed over the ranks that
    hold the same expert (dp_group), then divided by the world size, not by dp."""
    world_size = dist.get_world_size()
    mine = {id(p) for p in local_experts.parameters()}
    trained = [p for p in model.parameters() if p.grad is not None]  # the other ranks' experts have none
    # TODO(exercise 18): each gradient summed in its group (which one for an expert's?), then divided.
    ### BEGIN SOLUTION
    for p in trained:
        dist.all_reduce(p.grad, group=mesh.dp_group if id(p) in mine else None)
        p.grad /= world_size
    ### END SOLUTION


def train(config: ModelConfig, dp: int, ep: int, per_rank: int, k: int, capacity_factor, aux_weight: float) -> dict:
    """Train the MoE classifier on a dp x ep mesh, each rank its block of every batch's rows; rank 0 also
    trains the same model alone on the whole batches. Every rank's traffic comes back."""
    rank, world_size, device = dist.get_rank(), dist.get_world_size(), current_device()
    mesh = expert_mesh(dp, ep)
    torch.manual_seed(config.seed)  # the same whole model on every rank: each keeps its experts of it
    full = MoEModel(config, ep * per_rank).to(device)
    alone = MoEModel(config, ep * per_rank).to(device) if rank == 0 else None
    if alone is not None:
        alone.load_state_dict(full.state_dict())
    moe = MoE(full.router, list(full.experts), k, capacity_factor, mesh.ep_group)
    held = [p for name, p in full.named_parameters() if not name.startswith("experts.")] + list(moe.local.parameters())
    optimizer = torch.optim.SGD(held, lr=config.lr)
    alone_optimizer = torch.optim.SGD(alone.parameters(), lr=config.lr) if alone is not None else None
    train_set, _ = split_dataset(*(t.to(device) for t in gen_dataset(config, rand_state=config.seed)))
    rows = config.batch_size // world_size
    received, dropped, sent_rows, step_times = torch.zeros(per_rank, dtype=torch.int64), 0, 0, []
    history = {"received": [], "dropped": []}  # this rank's, by step: what --plot draws
    terms = []  # the world's mean task and balance losses, by step: the same on every rank, kept once
    for step, x, y in batches(*train_set, config.batch_size, config.seed):
        if step == config.niters:
            break
        synchronize(device)
        t0 = time.perf_counter()
        optimizer.zero_grad()
        mx, my = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
        task = F.cross_entropy(full(mx, moe), my)
        loss = task + aux_weight * moe.aux
        loss.backward()
        sync_gradients(full, moe.local, mesh)
        optimizer.step()
        # Over the world: the loss, and its two terms apart (the balance loss is 1 at its least, an even load).
        means = torch.stack([loss.detach(), task.detach(), moe.aux.detach()])
        dist.all_reduce(means)
        means /= world_size
        synchronize(device)
        step_times.append((time.perf_counter() - t0) * 1000)
        received += moe.stats["received"].cpu()
        dropped += moe.stats["dropped"]
        history["received"].append(moe.stats["received"].tolist())
        history["dropped"].append(moe.stats["dropped"])
        terms.append(means[1:])
        sent_rows += sum(n for r, n in enumerate(moe.stats["sent"]) if r != dist.get_rank(mesh.ep_group))
        if alone is not None:
            alone_optimizer.zero_grad()
            losses = []
            for r in range(world_size):
                out = {}

                def mixture(h, out=out):
                    h, out["aux"] = mixture_alone(alone.router, list(alone.experts), k, capacity_factor, h)
                    return h

                blocks = slice(r * rows, (r + 1) * rows)
                losses.append(F.cross_entropy(alone(x[blocks], mixture), y[blocks]) + aux_weight * out["aux"])
            alone_loss = torch.stack(losses).mean()
            alone_loss.backward()
            alone_optimizer.step()
            if step % 50 == 0:
                print(f"step {step} | train_loss {means[0].item():.4f} | one process {alone_loss.item():.4f}")
    width = config.d_hidden * torch.finfo(torch.float32).bits // 8
    did = {"received": received.tolist(), "dropped": dropped, "bytes_sent": 2 * sent_rows * width, "history": history}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, did)
    return {
        "train_loss": means[0].item(),
        "task_loss": means[1].item(),
        "balance_loss": means[2].item(),
        "loss_terms": torch.stack(terms).tolist(),
        "one_process_loss": alone_loss.item() if alone is not None else None,
        "ranks": everyone,
        "step_ms": statistics.median(step_times),
    }


def plot(ranks: list, terms: list, ep: int, path: str) -> None:
    """Tokens each expert received, choices dropped and the loss's two terms, step by step, from train()'s "ranks"
    and "loss_terms" on a mesh of ep ranks a row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (load, drops, loss) = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    for r, did in enumerate(ranks):
        steps = range(len(did["history"]["received"]))
        per_rank = len(did["received"])
        for i, counts in enumerate(zip(*did["history"]["received"])):
            load.plot(steps, counts, linewidth=0.8, label=f"expert {r % ep * per_rank + i} on rank {r}")
        drops.plot(steps, did["history"]["dropped"], linewidth=0.8, label=f"rank {r}")
    for term, values in zip(("task", "balance"), zip(*terms)):
        loss.plot(range(len(values)), values, label=f"{term} loss")
    load.set_ylabel("tokens received")
    drops.set_ylabel("choices dropped")
    loss.set_ylabel("loss, mean over the ranks")
    loss.legend(fontsize=7)
    loss.set_xlabel("step")
    load.legend(fontsize=7, ncol=2)
    drops.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--dp", type=whole(1), default=1, help="expert-parallel groups (the mesh's rows)")
    parser.add_argument("--ep", type=whole(1), default=2, help="ranks that hold the experts between them")
    parser.add_argument("--experts-per-rank", type=whole(1), default=2)
    parser.add_argument("--top-k", type=whole(1), default=2, help="experts per token")
    parser.add_argument(
        "--capacity-factor",
        type=float,
        default=None,
        help="each expert takes this times an even share of a rank's choices",
    )
    parser.add_argument("--aux-weight", type=float, default=0.01, help="the balance loss's weight in the loss")
    parser.add_argument(
        "--plot",
        metavar="FILE",
        help="draw each expert's tokens, the choices dropped and the loss by step (.png, .svg)",
    )
    parser.set_defaults(niters=200, dim_in=64, dim_hidden=32, n_classes=8, batch_size=64)
    args = parser.parse_args()
    world_size = args.dp * args.ep
    if args.world_size not in (1, world_size):  # 1: not given
        parser.error(f"--world-size {args.world_size} is not --dp {args.dp} x --ep {args.ep}: give --dp and --ep only")
    if args.top_k > args.ep * args.experts_per_rank:
        parser.error(f"--top-k {args.top_k}: there are {args.ep * args.experts_per_rank} experts")
    if args.batch_size % world_size:
        parser.error(f"--batch-size {args.batch_size} does not divide over {world_size} ranks")
    if args.plot and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
        parser.error(f"--plot {args.plot}: no folder {os.path.dirname(args.plot)}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print(
            f"no {args.plot} at the end: matplotlib is not installed (make notebooks, or python3 -m course setup --notebooks)"
        )
        args.plot = None
    config = config_from(args)
    result = launch(
        train, world_size, config, args.dp, args.ep, args.experts_per_rank, args.top_k, args.capacity_factor,
        args.aux_weight, **launch_options(args),
    )[0]  # fmt: skip
    print(
        f"final | train_loss {result['train_loss']:.4f} | one process {result['one_process_loss']:.4f}"
        f" | task loss {result['task_loss']:.4f} | balance loss {result['balance_loss']:.4f}"
        f" | median step time {result['step_ms']:.2f}ms"
    )
    for r, did in enumerate(result["ranks"]):
        print(
            f"rank {r}: tokens received per expert {did['received']}, dropped {did['dropped']},"
            f" {did['bytes_sent']} B sent to other ranks"
        )
    experts = [n for did in result["ranks"] for n in did["received"]]
    ranks = [sum(did["received"]) for did in result["ranks"]]
    print(
        f"load: the busiest expert took {max(experts) / statistics.mean(experts):.2f}x the mean expert's tokens, the"
        f" busiest rank {max(ranks) / statistics.mean(ranks):.2f}x the mean rank's;"
        f" {sum(did['dropped'] for did in result['ranks'])} choices dropped in all"
    )
    if args.plot:
        plot(result["ranks"], result["loss_terms"], args.ep, args.plot)
        print(f"wrote {args.plot}")
