"""The checks of exercise 18 catch the classic mistakes of a mixture of experts over ranks.

Instructors only: these need solutions/. Each case makes a mutant of the reference with one mistake and shows
that a check fails on it, with a message that points at the mistake.
"""

import pytest

from checks import test_ex18_moe as checks
from tests.mutants import assert_caught

MUTANTS = {
    "top-k weights renormalized over the k": (
        "moe.py",
        "    return weights, experts, probs\n    ### END SOLUTION",
        "    return weights / weights.sum(dim=-1, keepdim=True), experts, probs\n    ### END SOLUTION",
        lambda folder: checks.test_route(folder, 2),
        "not renormalized",
    ),
    "experts of the smallest probabilities": (
        "moe.py",
        "weights, experts = probs.topk(k, dim=-1)",
        "weights, experts = probs.topk(k, dim=-1, largest=False)",
        lambda folder: checks.test_route(folder, 1),
        "each token's 1 experts of the largest probabilities",
    ),
    "balance loss's fractions over the tokens, not the choices": (
        "moe.py",
        "minlength=n).to(probs.dtype) / experts.numel()",
        "minlength=n).to(probs.dtype) / len(experts)",
        lambda folder: checks.test_balance_loss(folder, 2),
        "f_e: the fraction of the tokens x k choices",
    ),
    "balance loss without its factor n": (
        "moe.py",
        "    return n * (f * probs.mean(dim=0)).sum()",
        "    return (f * probs.mean(dim=0)).sum()",
        lambda folder: checks.test_balance_loss(folder, 1),
        "not n * sum_e f_e * P_e",
    ),
    "capacity counted over the rank's choices, not each expert's": (
        "moe.py",
        "    place = (chosen.cumsum(dim=0) * chosen).sum(dim=-1) - 1\n",
        "    place = torch.arange(len(chosen))\n",
        checks.test_within_capacity,
        "where each keeps up to",
    ),
    "capacity keeps one choice too many": (
        "moe.py",
        "    return (place < limit).view_as(experts)",
        "    return (place <= limit).view_as(experts)",
        checks.test_within_capacity,
        "where each keeps up to",
    ),
    "counts not exchanged: each rank guesses it receives what it sends": (
        "moe.py",
        "    received = torch.empty_like(counts)\n    dist.all_to_all_single(received, counts, group=group)\n",
        "    received = counts.clone()\n",
        lambda folder: checks.test_exchange_counts(folder, 2, 2, 2),
        "no rank knows these in advance",
    ),
    "counts gathered from the whole world": (
        "moe.py",
        "    received = torch.empty_like(counts)\n    dist.all_to_all_single(received, counts, group=group)\n"
        "    return received.view(dist.get_world_size(group), -1)\n",
        "    everyone = [torch.empty_like(counts) for _ in range(dist.get_world_size())]\n"
        "    dist.all_gather(everyone, counts)\n"
        "    ranks, me = dist.get_process_group_ranks(group), dist.get_rank(group)\n"
        "    per_rank = len(counts) // len(ranks)\n"
        "    return torch.stack([everyone[r][me * per_rank : (me + 1) * per_rank] for r in ranks])\n",
        checks.test_traffic,
        "the counts went to ranks [[0, 1, 2, 3]]",
    ),
    "the counts exchanged without their group": (
        "moe.py",
        "    dist.all_to_all_single(received, counts, group=group)\n",
        "    dist.all_to_all_single(received, counts)\n",
        lambda folder: checks.test_exchange_counts(folder, 4, 2, 1),
        "they travel in the group [0, 1]",
    ),
    "rows not sorted by expert before they leave": (
        "moe.py",
        "    order = torch.argsort(chosen, stable=True)\n",
        "    order = torch.arange(len(chosen))\n",
        lambda folder: checks.test_layer(folder, 2),
        "not one process's mixture",
    ),
    "every block through the rank's first expert": (
        "moe.py",
        "local[i % len(local)](block)",
        "local[0](block)",
        lambda folder: checks.test_layer(folder, 2),
        "not one process's mixture",
    ),
    "outputs not put back in their tokens' order": (
        "moe.py",
        "    return x.index_add(0, sent.tokens, back * sent.weights.unsqueeze(-1))",
        "    return x.index_add(0, sent.tokens.sort().values, back * sent.weights.unsqueeze(-1))",
        lambda folder: checks.test_layer(folder, 2),
        "not one process's mixture",
    ),
    "the combine's weights detached": (
        "moe.py",
        "back * sent.weights.unsqueeze(-1))",
        "back * sent.weights.detach().unsqueeze(-1))",
        lambda folder: checks.test_layer(folder, 2),
        "the router has no gradient",
    ),
    "dropped tokens' outputs zero instead of the token itself": (
        "moe.py",
        "    return x.index_add(0, sent.tokens, back * sent.weights.unsqueeze(-1))",
        "    return torch.zeros_like(x).index_add(0, sent.tokens, back * sent.weights.unsqueeze(-1))",
        lambda folder: checks.test_layer(folder, 2),
        "not one process's mixture",
    ),
    "backward returns the gradient as it came": (
        "moe.py",
        "        return sent_back, None, None, None",
        "        return grad, None, None, None",
        checks.test_all_to_all,
        "the backward sends each row's gradient back to the rank it came from (the sizes swapped)",
    ),
    "the all-to-all in the world, not the expert-parallel group": (
        "moe.py",
        "        dist.all_to_all_single(received, x.contiguous(), recv_sizes, send_sizes, group=group)",
        "        dist.all_to_all_single(received, x.contiguous(), recv_sizes, send_sizes)",
        checks.test_traffic,
        "not equal to group size (at moe.py:",
    ),
    "experts' gradients divided by dp, not the world size": (
        "moe.py",
        "        p.grad /= world_size",
        "        p.grad /= mesh.dp if id(p) in mine else world_size",
        lambda folder: checks.test_steps(folder, 2, 2),
        "divided by the world size",
    ),
    "experts' gradients summed over the world, not the dp group": (
        "moe.py",
        "group=mesh.dp_group if id(p) in mine else None)",
        "group=None)",
        lambda folder: checks.test_steps(folder, 2, 2),
        "summed over the ranks that hold it",
    ),
}


@pytest.mark.parametrize("mistake", sorted(MUTANTS))
def test_mistake_is_caught(mistake, tmp_path):
    assert_caught(tmp_path / "mutant", mistake, *MUTANTS[mistake])
