"""The n-gram and suffix proposers against brute-force references written from their
definitions (O(n^2) scans, no index), on random and repetitive token streams."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from kvflow.services.scheduler.spec_decode.ngram import NgramIndex, NgramProposer
from kvflow.services.scheduler.spec_decode.suffix import SuffixProposer
from kvflow.services.scheduler.spec_decode.suffix_tree import SuffixTree

# ---- n-gram -------------------------------------------------------------------------


def ngram_reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    length = len(tokens)
    for n in range(min(max_n, length), min_n - 1, -1):
        suffix = tokens[length - n :]
        for end in range(length - 1, n - 1, -1):  # latest earlier occurrence first
            if tokens[end - n : end] == suffix:
                seq = list(tokens)
                for j in range(k):
                    seq.append(seq[end + j])
                return seq[length:]
    return []


def token_streams(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    streams = []
    for _ in range(count):
        vocab = rng.choice([2, 3, 5, 50])
        base = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        stream = []
        while len(stream) < 60:  # pieces of `base` with random edits: repetitive text
            piece = base[rng.randrange(len(base)) :]
            stream += [t if rng.random() > 0.2 else rng.randrange(vocab) for t in piece]
        streams.append(stream)
    return streams


@pytest.mark.parametrize(("min_n", "max_n"), [(1, 1), (1, 3), (2, 5), (3, 3)])
def test_ngram_matches_reference_at_every_length(min_n: int, max_n: int) -> None:
    for stream in token_streams(seed=min_n * 10 + max_n, count=40):
        index = NgramIndex(min_n, max_n)
        for length in range(1, len(stream) + 1):
            index.sync(stream[:length])
            for k in (1, 4):
                expected = ngram_reference(stream[:length], min_n, max_n, k)
                assert index.propose(k) == expected, (stream[:length], k)


def test_ngram_exact_cases() -> None:
    index = NgramIndex(2, 3)
    index.sync([7, 1, 2, 3, 4, 9, 1, 2, 3])
    assert index.propose(3) == [4, 9, 1]  # "1 2 3" seen before, followed by 4 9 1
    index.sync([7, 1, 2, 3, 4, 9, 1, 2, 3, 5])
    assert index.propose(3) == []  # "3 5" and "2 3 5" never occurred before
    periodic = NgramIndex(1, 2)
    periodic.sync([5, 6, 5, 6])
    assert periodic.propose(5) == [5, 6, 5, 6, 5]  # the copy runs into itself


def test_ngram_proposer_forgets_finished_requests() -> None:
    proposer = NgramProposer(1, 2)
    assert proposer.propose("a", [1, 2, 1], 3, 2) == [2, 1]
    proposer.finish("a", [1, 2, 1], 3)
    assert proposer.indexes == {}


# ---- suffix tree --------------------------------------------------------------------


def occurrences(docs: Sequence[Sequence[int]], s: Sequence[int], depth: int) -> int:
    """count(s): start positions whose depth-limited path begins with s."""
    if len(s) > depth:
        return 0
    n = len(s)
    return sum(
        1 for doc in docs for i in range(len(doc) - n + 1) if list(doc[i : i + n]) == list(s)
    )


def continuation_reference(
    docs: Sequence[Sequence[int]],
    context: list[int],
    depth: int,
    k: int,
    factor: float,
    min_prob: float,
) -> tuple[list[int], float]:
    vocab = sorted({t for doc in docs for t in doc})

    def children(s: list[int]) -> dict[int, int]:
        counts = {c: occurrences(docs, [*s, c], depth) for c in vocab}
        return {c: n for c, n in counts.items() if n > 0}

    for length in range(min(depth - 1, len(context)), 0, -1):
        s = context[len(context) - length :]
        if occurrences(docs, s, depth) and children(s):
            break
    else:
        return [], 0.0
    max_tokens = min(k, max(1, int(factor * length)))
    out: list[int] = []
    prob = score = 0.0
    prob = 1.0
    while len(out) < max_tokens:
        kids = children(s)
        if not kids:
            break
        best = max(kids, key=lambda c: (kids[c], -c))
        prob *= kids[best] / sum(kids.values())
        if prob < min_prob:
            break
        out.append(best)
        score += prob
        s = [*s, best]
    return out, score


def tree_counts(tree: SuffixTree) -> dict[tuple[int, ...], int]:
    """Every node's path -> count."""
    out: dict[tuple[int, ...], int] = {}
    stack = [((), tree.root)]
    while stack:
        path, node = stack.pop()
        for token_id, child in node.children.items():
            out[(*path, token_id)] = child.count
            stack.append(((*path, token_id), child))
    return out


@pytest.mark.parametrize("depth", [2, 3, 6])
def test_suffix_tree_counts_equal_brute_force(depth: int) -> None:
    docs = token_streams(seed=depth, count=4)
    tree = SuffixTree(depth)
    for i, doc in enumerate(docs):
        for start in range(0, len(doc), 7):  # grown in pieces, like a request's output
            tree.extend(i, doc[start : start + 7])
    counts = tree_counts(tree)
    for path, count in counts.items():
        assert count == occurrences(docs, path, depth), path
    expected_paths = {
        tuple(doc[i : i + n])
        for doc in docs
        for i in range(len(doc))
        for n in range(1, depth + 1)
        if i + n <= len(doc)
    }
    assert set(counts) == expected_paths


def test_suffix_tree_remove_equals_rebuild() -> None:
    docs = token_streams(seed=11, count=5)
    tree = SuffixTree(5)
    for i, doc in enumerate(docs):
        tree.extend(i, doc)
    for i in (0, 3):
        tree.remove(i)
    rebuilt = SuffixTree(5)
    for i in (1, 2, 4):
        rebuilt.extend(i, docs[i])
    assert tree_counts(tree) == tree_counts(rebuilt)
    for i in (1, 2, 4):
        tree.remove(i)
    assert tree.root.children == {} and tree.num_nodes() == 0


@pytest.mark.parametrize(
    ("depth", "factor", "min_prob"), [(4, 1.0, 0.1), (8, 2.0, 0.0), (6, 0.5, 0.4)]
)
def test_suffix_proposals_equal_brute_force(depth: int, factor: float, min_prob: float) -> None:
    for stream in token_streams(seed=depth, count=12):
        tree = SuffixTree(depth)
        for length in range(1, len(stream) + 1):
            tree.extend(0, stream[length - 1 : length])
            context = stream[:length]
            expected = continuation_reference([context], context, depth, 5, factor, min_prob)
            match = tree.longest_match(context)
            if match is None:
                assert expected == ([], 0.0)
                continue
            node, matched = match
            max_tokens = min(5, max(1, int(factor * matched)))
            got = tree.continuation(node, max_tokens, min_prob)
            assert got.token_ids == expected[0], context
            assert got.score == pytest.approx(expected[1])


def test_suffix_proposer_uses_recent_outputs_and_evicts() -> None:
    proposer = SuffixProposer(
        max_depth=8, max_cached_requests=2, max_spec_factor=2.0, min_token_prob=0.0
    )
    prompt = [100, 101]
    proposer.propose("a", prompt, 2, 4)
    proposer.finish("a", [*prompt, 1, 2, 3, 4, 5, 6], 2)
    # A new request whose output so far ends in "2 3": the cached output continues it.
    assert proposer.propose("b", [200, 2, 3], 1, 3) == [4, 5, 6]
    proposer.finish("b", [200, 2, 3], 1)
    proposer.finish("c", [9, 50, 51], 1)
    proposer.finish("d", [9, 60, 61], 1)  # evicts "a" (b and c, d are newer)
    assert list(proposer.cached_ids) == ["c", "d"]
    assert proposer.propose("e", [2, 3], 2, 3) == []
    rebuilt = SuffixTree(8)
    rebuilt.extend("c", [50, 51])
    rebuilt.extend("d", [60, 61])
    assert tree_counts(proposer.cache) == tree_counts(rebuilt)
    assert proposer.own.keys() == {"e"}


def test_suffix_proposer_prefers_the_stronger_tree() -> None:
    proposer = SuffixProposer(max_depth=6, max_cached_requests=4, min_token_prob=0.0)
    for i in range(3):  # three cached outputs agree: "5 6" -> 7 8
        proposer.finish(f"old{i}", [0, 5, 6, 7, 8], 1)
    # The request's own text once continued "5 6" with 9: score 1 + 1 (= 2 tokens)
    # against the cache's 1 + 1 too; a tie goes to the request's own tree.
    assert proposer.propose("r", [5, 6, 9, 4, 5, 6], 6, 2) == [9, 4]
    # With a disagreeing own history (9 once, 7 once) the unanimous cache wins.
    assert proposer.propose("s", [5, 6, 9, 1, 5, 6, 7, 2, 5, 6], 10, 2) == [7, 8]
