"""Exercise 18: expert parallelism, against one process's mixture of the same experts and torch's all-to-all.

Each rank is given its own tokens and, of the experts, its own only (the others' weights are other numbers
drawn for that rank alone): a layer whose outputs are one process's got the other experts' work through its
exchanges. The judge computes one process's mixture itself (mixture() below, from the weights it gave out), and
the all-to-all's reference is torch's autograd all-to-all in a reference world. Which group a collective went to
is taken from the process group it was called on (checks/comm_log.py), never from what the code under test says.
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_autograd
import torch.nn as nn

from checks.comm_log import SUMMARY, CommLog
from checks.helpers import Given, drawn, load, many, reference_world, tensor, world
from course.grading.points import said

# No world of these checks builds a torch optimizer: grading them alone need not import torch._dynamo.
IMPORTS_DYNAMO = False

WIDTH = 4  # of a token
TOKENS = 6  # a rank's, in the layer's cases; rank r has TOKENS + r % 2 of them (an uneven load)
BIAS = 30.0  # a router bias that decides the choice: an expert every token takes, or none does


def close(got, expected):
    return got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-6, atol=1e-9)


# --- Routing, the balance loss and the capacity: one process ------------------------------------------


def route_in_world(folder, k, logits):
    weights, experts, probs = load(folder).moe.route(logits, k)
    return [weights, experts, probs]


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.points(1)
def test_route(impl_dir, k):
    """route: the softmax over all the experts, each token's k largest probabilities, largest first, as they are."""
    given = Given(lambda: [torch.randn(7, 5, generator=drawn(k), dtype=torch.float64)], lambda value: [tuple(value)])
    expect = (tensor(), tensor(), tensor())
    weights, experts, probs = world(route_in_world, 1, impl_dir, k, expect=expect, per_rank=given)[0]
    want_probs = given.value[0].softmax(dim=-1)
    want_weights, want_experts = want_probs.topk(k, dim=-1)
    what = f"route of 7 tokens over 5 experts, k = {k}"
    assert close(probs, want_probs), said(
        "probs not the softmax over the experts", f"{what}: probs is not the softmax of each token's scores"
    )
    assert experts.dtype == torch.int64 and torch.equal(experts, want_experts), said(
        "not each token's k best experts",
        f"{what}: experts is {experts.tolist()[:2]}... where each token's {k} experts of the largest probabilities,"
        f" largest first, are {want_experts.tolist()[:2]}...",
    )
    renormalized = want_weights / want_weights.sum(dim=-1, keepdim=True)
    assert not close(weights, renormalized) or close(renormalized, want_weights), said(
        "top-k weights renormalized",
        f"{what}: the weights sum to 1 over each token's {k} experts; they are the chosen probabilities as they"
        " are, not renormalized (with k = 1 every weight would be 1, and the router would learn nothing)",
    )
    assert close(weights, want_weights), said(
        "weights not the chosen probabilities", f"{what}: the weights are not the probabilities of the chosen experts"
    )


def balance_in_world(folder, probs, experts):
    probs = probs.clone().requires_grad_()
    loss = load(folder).moe.balance_loss(probs, experts)
    loss.backward()
    return [loss.detach(), probs.grad if probs.grad is not None else torch.zeros(0)]


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.points(1)
def test_balance_loss(impl_dir, k):
    """balance_loss: n * sum over experts of f_e * P_e, f the fraction of the tokens x k choices, its gradient through P."""

    def make():
        g = drawn(10 + k)
        probs = torch.randn(8, 4, generator=g, dtype=torch.float64).softmax(dim=-1)
        return [probs, probs.topk(k, dim=-1).indices]

    given = Given(make, lambda value: [tuple(value)])
    loss, grad = world(balance_in_world, 1, impl_dir, expect=(tensor([]), tensor(None)), per_rank=given)[0]
    probs, experts = given.value
    leaf = probs.clone().requires_grad_()
    # Written out here, not as a function: a function of the checks that computes a student function's answer
    # is one that the submission, which can import the checks, could call (issue 47).
    want = 4 * sum((experts == e).sum().item() / experts.numel() * leaf[:, e].mean() for e in range(4))
    want.backward()
    what = f"the balance loss of 8 tokens over 4 experts, k = {k}"
    assert torch.allclose(loss, want.detach()), said(
        "not the Switch balance loss",
        f"{what} is {loss.item():.6f}, not n * sum_e f_e * P_e = {want.item():.6f} (f_e: the fraction of the"
        " tokens x k choices that went to expert e; P_e: the mean over the tokens of probs[:, e])",
    )
    assert grad.shape == probs.shape and torch.allclose(grad, leaf.grad), said(
        "the balance loss's gradient not through P alone",
        f"{what}: its gradient with respect to probs is not n * f_e / tokens in column e: f is a count, with no"
        " gradient; P carries it to the router",
    )


def capacity_in_world(folder, cases):
    moe = load(folder).moe
    return [moe.within_capacity(experts, n, limit) for experts, n, limit in cases]


@pytest.mark.points(3)
def test_within_capacity(impl_dir):
    """within_capacity: each expert keeps its first `limit` choices in token order, per expert; every one for None."""

    def make():
        g = drawn(20)
        spread = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(9)])
        return [
            (spread, 4, 3),
            (spread, 4, None),
            (torch.zeros(7, 1, dtype=torch.int64), 3, 2),  # every token to one expert
            (torch.randint(0, 5, (10, 1), generator=g), 5, 1),
            (spread, 4, 0),
        ]

    given = Given(make, lambda value: [(value,)])
    got = world(capacity_in_world, 1, impl_dir, expect=many(tensor(), 5), per_rank=given)[0]
    for (experts, n, limit), mask in zip(given.value, got):
        what = (
            f"within_capacity of {experts.shape[0]} tokens x {experts.shape[1]} choices over {n} experts, limit {limit}"
        )
        assert mask.dtype == torch.bool and mask.shape == experts.shape, said(
            "within_capacity not a mask of the choices",
            f"{what}: returned a {mask.dtype} tensor of shape {list(mask.shape)}, not a bool tensor of the choices'"
            f" shape {list(experts.shape)}",
        )
        # Judged by what the mask must be, expert by expert, not recomputed: no function here answers for the
        # student's (issue 47: the submission can import the checks).
        theirs = [mask.reshape(-1)[experts.reshape(-1) == e] for e in range(n)]  # each expert's, in token order
        allowed = [len(t) if limit is None else min(limit, len(t)) for t in theirs]
        per_expert = [int(t.sum()) for t in theirs]
        assert per_expert == allowed, said(
            "the capacity not per expert",
            f"{what}: the experts keep {per_expert} choices, where each keeps up to {limit} of its own: {allowed}",
        )
        assert all(t[:a].all() for t, a in zip(theirs, allowed)), said(
            "not the first choices in token order kept",
            f"{what}: kept {mask.int().tolist()}: each expert keeps the first of its choices in token order (token"
            " 0's before token 1's, a token's first choice before its second)",
        )


# --- The counts, and the rows both ways ----------------------------------------------------------


def counts_in_world(folder, ep, counts):
    """Probe: exchange_counts in this rank's expert-parallel group (the world's ranks in rows of ep)."""
    group = groups_of(ep)
    with CommLog() as log:
        received = load(folder).moe.exchange_counts(counts, group)
    return [received, log.summary()]


@pytest.mark.parametrize(
    "world_size, ep, per_rank", [pytest.param(2, 2, 2, marks=pytest.mark.points(2)), (4, 2, 1)], ids=["2-2", "4-1"]
)
@pytest.mark.points(1)
def test_exchange_counts(impl_dir, world_size, ep, per_rank):
    """exchange_counts: row s, what the group's rank s sends to each of this rank's experts; no rank guesses them.

    On 4 ranks the groups are pairs of ranks, so that counts exchanged in the world are told from the group's."""
    n = ep * per_rank

    def make():
        g = drawn(30 + world_size)
        counts = torch.randint(0, 9, (world_size, n), generator=g)
        counts[:, per_rank : 2 * per_rank] = 0  # each group's second rank receives nothing
        return counts

    given = Given(make, lambda counts: [(row.clone(),) for row in counts])
    results = world(counts_in_world, world_size, impl_dir, ep, expect=(tensor(), SUMMARY), per_rank=given)
    counts = given.value
    for rank, (received, log) in enumerate(results):
        group, mine = list(range(rank // ep * ep, rank // ep * ep + ep)), rank % ep
        want = torch.stack([counts[s, mine * per_rank : (mine + 1) * per_rank] for s in group])
        what = f"with {world_size} ranks in groups {group if ep < world_size else 'of the world'}, {per_rank} expert"
        what += f"{'s' * (per_rank > 1)} each, rank {rank}"
        # The group first: counts exchanged in the world come back wrong because of it.
        assert all(g == group for g in log["collective_groups"]), said(
            "the counts exchanged in the world, not the expert-parallel group",
            f"{what}: the counts went to ranks {log['collective_groups']}: they travel in the group {group}",
        )
        assert received.shape == want.shape and torch.equal(received.to(want.dtype), want), said(
            "the counts not exchanged",
            f"{what} expects {want.tolist()} (row s: what the group's rank s sends to each of its experts), and"
            f" exchange_counts returned {received.tolist()}: no rank knows these in advance; each learns them from"
            " the others of its group",
        )
        assert log["collectives"], said(
            "the counts not exchanged", f"{what}: exchange_counts started no collective: the counts must travel"
        )


def all_to_all_in_world(folder, x, send, recv, upstream):
    """Probe: AllToAll forward, then its backward called as autograd calls it (the node of its output is its ctx),
    but without autograd's check of the gradient's shape: a gradient of the wrong shape comes back to be judged,
    where autograd would raise in the probe's own line."""
    x = x.clone().requires_grad_()
    out = load(folder).moe.AllToAll.apply(x, send, recv, dist.group.WORLD)
    node = out.grad_fn
    grads = type(node)._forward_cls.backward(node, upstream)
    grad = grads[0] if isinstance(grads, (tuple, list)) else grads
    return [out.detach(), grad.detach() if isinstance(grad, torch.Tensor) else torch.zeros(0)]


def torchs_all_to_all(x, send, recv, upstream):
    """Torch's own autograd all-to-all, on the same rows: what AllToAll is compared with (a reference world).

    torch.distributed.nn's, not _functional_collectives' all_to_all_single_autograd (torchtitan's): the first call of
    that one imports torch._dynamo, 1.3 s of a 5 s grade on 2 cores. Both are an all_to_all_single forward and the
    reverse one backward."""
    x = x.clone().requires_grad_()
    out = dist_autograd.all_to_all_single(x.new_empty(sum(recv), *x.shape[1:]), x, recv, send, dist.group.WORLD)
    (out * upstream).sum().backward()
    return [out.detach(), x.grad]


@pytest.mark.points(4)
def test_all_to_all(impl_dir):
    """AllToAll: forward, each block of rows to its rank; backward, the gradient back the way the rows came; as torch's.

    On 2 ranks: torch's all-to-all runs in a reference world, and other exercises' checks keep one of 2 (a world of 4
    was one more to start, 5 s of a grade's 9 under load); the layer's checks run AllToAll on 4 ranks too."""
    world_size = 2

    def make():
        g = drawn(40 + world_size)
        sends = torch.randint(0, 4, (world_size, world_size), generator=g)
        sends[:, 0] += 1  # every rank sends rank 0 a row: a backward that returns its gradient as it came is caught
        sends[:, 1] = 0  # rank 1 receives no row
        xs = [torch.randn(int(row.sum()), 3, generator=g, dtype=torch.float64) for row in sends]
        upstream = [torch.randn(int(sends[:, r].sum()), 3, generator=g, dtype=torch.float64) for r in range(world_size)]
        return sends, xs, upstream

    def split(value):
        sends, xs, upstream = value
        return [(xs[r], sends[r].tolist(), sends[:, r].tolist(), upstream[r]) for r in range(world_size)]

    given = Given(make, split)
    expect = (tensor(), tensor())
    got = world(all_to_all_in_world, world_size, impl_dir, expect=expect, per_rank=given)
    want = reference_world(torchs_all_to_all, world_size, expect=expect, per_rank=Given(lambda: given.value, split))
    sends = given.value[0]
    for rank, ((out, grad), (want_out, want_grad)) in enumerate(zip(got, want)):
        what = f"with {world_size} ranks sending {sends.tolist()} rows (row r: what rank r sends to each), rank {rank}"
        assert close(out, want_out), said(
            "not the rows each rank sent it",
            f"{what} received rows of shape {list(out.shape)} that are not, in rank order, the blocks the ranks sent"
            " it: torch's all-to-all gives them",
        )
        assert grad.shape == want_grad.shape, said(
            "a backward without the reverse exchange",
            f"{what}: its input's gradient has shape {list(grad.shape)}, not its input's {list(want_grad.shape)}:"
            " the backward sends each row's gradient back to the rank it came from (the sizes swapped)",
        )
        assert close(grad, want_grad), said(
            "a backward without the reverse exchange",
            f"{what}: its input's gradient is not what torch's autograd all-to-all gives: the backward sends each"
            " row's gradient back to the rank it came from",
        )


# --- The layer: one process's mixture, and what travels ---------------------------------------------------


def expert_net():
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)).double()


def loaded(net, tensors):
    with torch.no_grad():
        for p, t in zip(net.parameters(), tensors):
            p.copy_(t)
    return net


def mixture(router, experts, k, limit, x):
    """The judge's one-process layer, token by token: router (weight, bias), experts [(w1, b1, w2, b2)]. Returns
    (output, balance loss)."""
    probs = (x @ router[0].T + router[1]).softmax(dim=-1)
    weights, chosen = probs.topk(k, dim=-1)
    taken, rows = [0] * len(experts), []
    for t in range(len(x)):
        row = x[t]
        for j in range(k):
            e = int(chosen[t, j])
            if limit is None or taken[e] < limit:
                taken[e] += 1
                w1, b1, w2, b2 = experts[e]
                row = row + weights[t, j] * (torch.tanh(x[t] @ w1.T + b1) @ w2.T + b2)
        rows.append(row)
    n = len(experts)
    aux = n * sum((chosen == e).sum().item() / chosen.numel() * probs[:, e].mean() for e in range(n))
    return torch.stack(rows) if rows else x * 1, aux


# (world size, experts per rank, k, capacity factor, router bias: None, "one" (every token to expert 0) or "none"
# (no token to rank 1's experts)), by world size: a world's cases run in one call.
LAYERS = {
    1: [(1, 2, 2, None, None)],
    2: [(2, 1, 1, None, None), (2, 2, 2, None, None), (2, 2, 2, 0.5, None), (2, 2, 1, None, "none")],
    4: [(4, 1, 2, 1.0, None), (4, 2, 1, None, "one")],
}


def limit_of(tokens, k, n, factor):
    return None if factor is None else math.ceil(factor * tokens * k / n)


def layer_case(case, seed, ep):
    """Every input of a layer case: the router, every expert, each rank's tokens and upstream gradient, and for
    each rank of an ep group its experts' tensors with every other expert's replaced by numbers drawn for that
    rank alone."""
    world_size, per_rank, k, factor, bias = case
    n, g = ep * per_rank, drawn(seed)
    router = [torch.randn(n, WIDTH, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)]
    if bias == "one":
        router[1][0] += BIAS
    elif bias == "none":
        router[1][per_rank : 2 * per_rank] -= BIAS
    shapes = [(WIDTH, WIDTH), (WIDTH,), (WIDTH, WIDTH), (WIDTH,)]
    experts = [[torch.randn(s, generator=g, dtype=torch.float64) * 0.5 for s in shapes] for _ in range(n)]
    xs = [torch.randn(TOKENS + r % 2, WIDTH, generator=g, dtype=torch.float64) for r in range(world_size)]
    upstream = [torch.randn(len(x), WIDTH, generator=g, dtype=torch.float64) for x in xs]
    others = [
        [
            e if i // per_rank == q else [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
            for i, e in enumerate(experts)
        ]
        for q in range(ep)
    ]
    return {"router": router, "experts": experts, "xs": xs, "upstream": upstream, "given": others}


def groups_of(ep):
    """This rank's expert-parallel group, the world's ranks in rows of ep: the world itself where ep is its size
    (a group made afresh costs every rank its connections and threads)."""
    if ep == dist.get_world_size():
        return dist.group.WORLD
    group, _ = dist.new_subgroups_by_enumeration([list(range(i, i + ep)) for i in range(0, dist.get_world_size(), ep)])
    return group


def layer_in_world(folder, ep, cases):
    """Probe: for each case (k, capacity factor, this rank's tokens, the router, the experts as this rank is given
    them, the upstream gradient), the MoE layer over this rank's expert-parallel group (ranks in rows of ep),
    forward and backward of (output * upstream).sum(); its output, gradients, balance loss and the log of the
    collectives, forward and backward apart."""
    moe, group = load(folder).moe, groups_of(ep)
    found = []
    for k, factor, x, router, experts, upstream in cases:
        net = loaded(nn.Linear(WIDTH, len(experts)).double(), router)
        nets = [loaded(expert_net(), e) for e in experts]
        x = x.clone().requires_grad_()
        layer = moe.MoE(net, nets, k, factor, group)
        with CommLog() as forward:
            y = layer(x)
        with CommLog() as backward:
            (y * upstream).sum().backward()
        first = dist.get_rank(group) * (len(experts) // ep)
        found.append(
            {
                "y": y.detach(),
                "aux": layer.aux.detach(),
                "x": grad_of(x),
                "router": [grad_of(p) for p in net.parameters()],
                "experts": [[grad_of(p) for p in e.parameters()] for e in nets[first : first + len(experts) // ep]],
                "forward": forward.summary(),
                "backward": backward.summary(),
            }
        )
    return found


def grad_of(p):
    return p.grad if p.grad is not None else torch.zeros(0)


LAYER = {
    "y": tensor(),
    "aux": tensor([]),
    "x": tensor(),
    "router": many(tensor(), 2),
    "experts": many(many(tensor(), 4)),
    "forward": SUMMARY,
    "backward": SUMMARY,
}


def run_layer(folder, cases, seed, ep=None):
    """The layer's cases, all of one world size, in one call of the world: by rank, each case's results; and
    each case's inputs."""
    world_size = cases[0][0]
    ep = ep or world_size

    def split(values):
        return [
            (
                ep,
                [
                    (c[2], c[3], v["xs"][r], v["router"], v["given"][r % ep], v["upstream"][r])
                    for c, v in zip(cases, values)
                ],
            )
            for r in range(world_size)
        ]

    inputs = Given(lambda: [layer_case(case, seed + i, ep) for i, case in enumerate(cases)], split)
    got = world(layer_in_world, world_size, folder, expect=many(LAYER, len(cases)), per_rank=inputs)
    return got, inputs.value


def judged_layer(case, value):
    """One process's outputs and gradients of the case: each rank's tokens through the same layer, expert e's
    gradient summed over every rank's tokens."""
    world_size, per_rank, k, factor, _ = case
    router = [t.clone().requires_grad_() for t in value["router"]]
    expert_grads = [[torch.zeros_like(t) for t in e] for e in value["experts"]]
    want = []
    for x, up in zip(value["xs"], value["upstream"]):
        experts = [[t.clone().requires_grad_() for t in e] for e in value["experts"]]
        x = x.clone().requires_grad_()
        for t in router:
            t.grad = None
        y, aux = mixture(router, experts, k, limit_of(len(x), k, len(experts), factor), x)
        (y * up).sum().backward()
        want.append({"y": y.detach(), "aux": aux.detach(), "x": x.grad, "router": [t.grad.clone() for t in router]})
        for e, ts in enumerate(experts):
            for i, t in enumerate(ts):
                if t.grad is not None:
                    expert_grads[e][i] += t.grad
    return want, expert_grads


@pytest.mark.parametrize(
    "world_size", [pytest.param(1, marks=pytest.mark.points(2)), pytest.param(2, marks=pytest.mark.points(4)), 4]
)
@pytest.mark.points(3)
def test_layer(impl_dir, world_size):
    """MoE: the output, the balance loss and every gradient (input, router, experts) are one process's mixture's."""
    cases = LAYERS[world_size]
    got, values = run_layer(impl_dir, cases, 50 + 10 * world_size)
    for c, (case, value) in enumerate(zip(cases, values)):
        judge_layer(case, value, [found[c] for found in got])


def judge_layer(case, value, got):
    """One case of the layer, every rank's results (got) against one process's."""
    world_size, per_rank, k, factor, bias = case
    want, expert_grads = judged_layer(case, value)
    routed = {"one": ", every token's first choice expert 0", "none": ", no token to rank 1's experts"}.get(bias, "")
    ranks, experts = f"{world_size} rank{'s' * (world_size > 1)}", f"{per_rank} expert{'s' * (per_rank > 1)}"
    where = f"{ranks} of {experts}, k = {k}, capacity factor {factor}{routed}"
    for rank, (mine, theirs) in enumerate(zip(got, want)):
        what = f"with {where}, rank {rank}"
        assert close(mine["y"], theirs["y"]), said(
            "not one process's mixture",
            f"{what}: the layer's output is not one process's mixture of the same router and experts on the same"
            " tokens. Each row travels to its expert's rank in expert order (dispatch), each (rank, expert) block"
            " goes through its own expert (run_experts), and each output comes back to its own token's row, weighted"
            " (combine)",
        )
        assert torch.allclose(mine["aux"], theirs["aux"]), said(
            "the layer's balance loss not its batch's",
            f"{what}: the layer's aux is {mine['aux'].item():.6f}, not the balance loss of its tokens' routing,"
            f" {theirs['aux'].item():.6f}",
        )
        no_router = all(g.numel() == 0 or not g.any() for g in mine["router"])
        assert not no_router or not any(g.any() for g in theirs["router"]), said(
            "the combine's weights detached",
            f"{what}: the router has no gradient: the outputs are weighted by the router's weights, and the"
            " gradient reaches the router through them",
        )
        assert close(mine["x"], theirs["x"]), said(
            "the input's gradient not one process's",
            f"{what}: the tokens' gradient is not one process's: the outputs' gradients go back to the tokens' ranks",
        )
        assert all(close(a, b) for a, b in zip(mine["router"], theirs["router"])), said(
            "the router's gradient not one process's", f"{what}: the router's gradient is not one process's"
        )
        first = rank * per_rank
        for i, grads in enumerate(mine["experts"]):
            assert all(close(a, b) for a, b in zip(grads, expert_grads[first + i])), said(
                "an expert's gradient not one process's",
                f"{what}: expert {first + i}'s gradient is not one process's, the sum of every rank's tokens' part",
            )


# The layer on a (dp, ep) mesh: exercise 16's idea, the all-to-alls in the ep group only.
TRAFFIC = (4, 2, 2, None, None)  # 4 ranks in rows of 2: experts 0-1 on ranks 0 and 2, 2-3 on 1 and 3
ALL_TO_ALLS = ("alltoall", "alltoall_base", "all_to_all_single")  # course/runtime/compat.py's names


def row_counts(value, case, ep):
    """Rows each rank sends to each rank of its ep group, and receives (the judge's own routing; no capacity)."""
    world_size, per_rank, k, factor, _ = case
    assert factor is None, "the traffic's case drops nothing"
    sent = []
    router = value["router"]
    for x in value["xs"]:
        chosen = (x @ router[0].T + router[1]).softmax(dim=-1).topk(k, dim=-1).indices
        sent.append([int((chosen // per_rank == q).sum()) for q in range(ep)])
    received = [sum(sent[(r // ep) * ep + s][r % ep] for s in range(ep)) for r in range(world_size)]
    return sent, received


def token_exchanges(log, dtype="float64"):
    return [i for i, (what, d) in enumerate(zip(log["collectives"], log["collective_dtypes"])) if d == dtype]


@pytest.mark.points(3)
def test_traffic(impl_dir):
    """The counts travel before the tokens; two all-to-alls of rows forward and two backward, in the ep group only."""
    ep = 2
    case = TRAFFIC
    got, values = run_layer(impl_dir, [case], 60, ep=ep)
    sent, received = row_counts(values[0], case, ep)
    got = [found[0] for found in got]
    row_bytes = WIDTH * 8
    for rank, found in enumerate(got):
        group = list(range(rank // ep * ep, rank // ep * ep + ep))
        what = f"with 4 ranks in expert-parallel groups of 2 ({group} is rank {rank}'s), rank {rank}"
        for direction, log in (("forward", found["forward"]), ("backward", found["backward"])):
            rows = token_exchanges(log)
            kinds = [log["collectives"][i] for i in rows]
            assert len(rows) == 2 and all(k in ALL_TO_ALLS for k in kinds), said(
                "not two all-to-alls of the tokens each way",
                f"{what}: the {direction} pass started {kinds or 'no collective'} on the tokens' rows, where a layer"
                " sends them by one all-to-all and brings them back by another",
            )
            groups = [log["collective_groups"][i] for i in rows]
            assert all(g == group for g in groups), said(
                "the all-to-all in the world, not the expert-parallel group",
                f"{what}: the {direction} pass's all-to-alls went to ranks {groups}: the tokens travel in the"
                f" expert-parallel group {group} only",
            )
        forward = found["forward"]
        first = token_exchanges(forward)[0]
        counted = list(range(first))  # the counts' collectives: whatever started before the tokens' rows
        assert counted, said(
            "the counts not exchanged before the tokens",
            f"{what}: no count travelled before the tokens: each rank learns how many rows it receives from each"
            " (exchange_counts) before the rows are sent",
        )
        groups = [forward["collective_groups"][i] for i in counted]
        assert all(g == group for g in groups), said(
            "the counts exchanged in the world, not the expert-parallel group",
            f"{what}: the counts went to ranks {groups}: they travel in the expert-parallel group {group}, as the"
            " tokens do",
        )
        # Backward, the same rows in reverse: first the outputs' gradients to the experts, then the rows' to their
        # tokens' ranks; each all-to-all logged with what it received.
        expected = [received[rank] * row_bytes, sum(sent[rank]) * row_bytes]
        for direction, log in (("forward", forward), ("backward", found["backward"])):
            nbytes = [log["collective_bytes"][i] for i in token_exchanges(log)]
            assert nbytes == expected, said(
                "not the rows the routing sends",
                f"{what}: the {direction} pass's all-to-alls received {nbytes} bytes, where the routing sends it"
                f" {received[rank]} rows and brings back the {sum(sent[rank])} it sent ({row_bytes} bytes each):"
                f" {expected}",
            )


# --- Expert and data parallel: training steps ---------------------------------------------------------

STEPS, LR, AUX = 2, 0.3, 0.1


def steps_in_world(folder, dp, ep, k, x, target, router, experts):
    """Probe: STEPS steps of SGD on the layer's squared error plus AUX times its balance loss, the gradients made
    the world's mean by sync_gradients; the router and this rank's experts after each."""
    moe = load(folder).moe
    rows = [list(range(i * ep, (i + 1) * ep)) for i in range(dp)]
    ep_group, _ = dist.new_subgroups_by_enumeration(rows)
    dp_group, _ = dist.new_subgroups_by_enumeration([list(c) for c in zip(*rows)])
    mesh = moe.ExpertMesh(dp, ep, ep_group, dp_group)
    net = loaded(nn.Linear(WIDTH, len(experts)).double(), router)
    layer = moe.MoE(net, [loaded(expert_net(), e) for e in experts], k, None, ep_group)
    after = []
    for _ in range(STEPS):
        layer.zero_grad()
        loss = ((layer(x) - target) ** 2).mean() + AUX * layer.aux
        loss.backward()
        moe.sync_gradients(layer, layer.local, mesh)
        with torch.no_grad():
            for p in layer.parameters():
                p -= LR * p.grad
        after.append(
            {
                "router": [p.detach().clone() for p in net.parameters()],
                "experts": [[p.detach().clone() for p in e.parameters()] for e in layer.local],
            }
        )
    return after


@pytest.mark.parametrize("dp, ep", [(2, 2), (1, 2)])
@pytest.mark.points(2)
def test_steps(impl_dir, dp, ep):
    """sync_gradients: training steps on a (dp, ep) mesh equal one process's steps on the mean of every rank's loss."""
    world_size, per_rank, k = dp * ep, 1, 2

    def make():
        value = layer_case((ep, per_rank, k, None, None), 70 + dp, ep)
        g = drawn(80 + dp)
        value["xs"] = [torch.randn(TOKENS, WIDTH, generator=g, dtype=torch.float64) for _ in range(world_size)]
        value["targets"] = [torch.randn(TOKENS, WIDTH, generator=g, dtype=torch.float64) for _ in range(world_size)]
        return value

    given = Given(
        make,
        lambda v: [(v["xs"][r], v["targets"][r], v["router"], v["given"][r % ep]) for r in range(world_size)],
    )
    expect = many({"router": many(tensor(), 2), "experts": many(many(tensor(), 4), per_rank)}, STEPS)
    got = world(steps_in_world, world_size, impl_dir, dp, ep, k, expect=expect, per_rank=given)
    value = given.value
    router = [t.clone() for t in value["router"]]
    experts = [[t.clone() for t in e] for e in value["experts"]]
    want = []
    for _ in range(STEPS):
        leaves = [t.requires_grad_() for t in router], [[t.requires_grad_() for t in e] for e in experts]
        losses = []
        for x, target in zip(value["xs"], value["targets"]):
            y, aux = mixture(leaves[0], leaves[1], k, None, x)
            losses.append(((y - target) ** 2).mean() + AUX * aux)
        torch.stack(losses).mean().backward()
        with torch.no_grad():
            router = [t - LR * t.grad for t in router]
            experts = [[t - LR * t.grad for t in e] for e in experts]
        want.append((router, experts))
    # Step by step, the router first: a mistake in the experts' gradients changes the router only a step later.
    for step, (router, experts) in enumerate(want):
        for rank, per_step in enumerate(got):
            judge_step(per_step[step], router, experts, rank, f"step {step + 1} on the mesh (dp {dp}, ep {ep})", ep)


def judge_step(found, router, experts, rank, where, ep):
    """One rank's router and experts after a step, against one process's."""
    assert all(close(a, b) for a, b in zip(found["router"], router)), said(
        "the router's gradient not the world's mean",
        f"{where}: rank {rank}'s router is not one process's: a parameter on every rank averages its gradient"
        " over the world (where test_layer fails too, the layer's own gradients are wrong before sync_gradients"
        " sees them)",
    )
    first = (rank % ep) * len(found["experts"])
    for i, tensors in enumerate(found["experts"]):
        assert all(close(a, b) for a, b in zip(tensors, experts[first + i])), said(
            "an expert's gradient not the world's mean",
            f"{where}: rank {rank}'s expert {first + i} is not one process's: its gradient is summed over the"
            " ranks that hold it (the dp group) and divided by the world size",
        )
