"""Decode CUDA graphs: the padding logic everywhere, replays vs eager on a GPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.gpu_worker.attn_metadata import AttentionMetadata
from kvflow.gpu_worker.cuda_graphs import capture_sizes
from kvflow.gpu_worker.graph_inputs import StaticDecodeInputs
from kvflow.gpu_worker.input_batch import ModelInputs


def test_capture_sizes_ladder() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(1024)[-1] == 512


def _decode_inputs(seq_lens: list[int], blocks: list[list[int]]) -> ModelInputs:
    n = len(seq_lens)
    width = max(len(b) for b in blocks)
    table = torch.tensor([b + [0] * (width - len(b)) for b in blocks], dtype=torch.int32)
    slots = torch.tensor([b[(s - 1) // 4] * 4 + (s - 1) % 4 for b, s in zip(blocks, seq_lens)])
    metadata = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=table,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=list(range(n + 1)),
        seq_lens_cpu=seq_lens,
        logits_indices=torch.arange(n),
    )
    ids = torch.tensor([11 * (i + 1) for i in range(n)])
    return ModelInputs(ids, torch.tensor(seq_lens) - 1, metadata, [f"r{i}" for i in range(n)])


def test_static_inputs_load_pads_with_inert_rows() -> None:
    static = StaticDecodeInputs.allocate(max_size=4, max_blocks=3, device=torch.device("cpu"))
    for inputs, size in [
        (_decode_inputs([5, 9, 2], [[7, 8], [1, 2, 3], [4]]), 4),
        (_decode_inputs([6], [[7, 8]]), 2),  # a smaller step after a larger one
    ]:
        static.load(inputs.input_ids, inputs.positions, inputs.metadata, size)
    assert static.input_ids[:2].tolist() == [11, 0]
    assert static.positions[:2].tolist() == [5, 0]
    assert static.slot_mapping[:2].tolist() == [8 * 4 + 1, -1]  # padding stores nothing
    assert static.seq_lens[:2].tolist() == [6, 1]
    assert static.block_tables[0, :2].tolist() == [7, 8]
    assert static.query_start_loc[:3].tolist() == [0, 1, 2]


def test_static_inputs_hold_every_kv_groups_tables() -> None:
    """A hybrid KV cache: the group's slot mapping and tables load beside group 0's, the
    static metadata hands them to the group's layers, and padding rows store nothing."""
    static = StaticDecodeInputs.allocate(4, 3, torch.device("cpu"), num_groups=2)
    inputs = _decode_inputs([5, 9], [[7, 8], [1, 2, 3]])
    md = inputs.metadata
    group = AttentionMetadata(**{**md.__dict__, "group_metadata": []})
    group.block_tables = torch.tensor([[-1, 4], [5, 6]], dtype=torch.int32)
    group.slot_mapping = torch.tensor([4 * 4 + 1, 6 * 4 + 0])
    md.group_metadata = [group]
    static.load(inputs.input_ids, inputs.positions, md, 4)
    assert static.group_slots[0].tolist() == [17, 24, -1, -1]
    assert static.group_tables[0][:2, :2].tolist() == [[-1, 4], [5, 6]]
    replay = static.metadata(4, 64)
    assert replay.of_group(1).block_tables.data_ptr() == static.group_tables[0].data_ptr()
    assert replay.of_group(1).seq_lens is replay.seq_lens


@pytest.mark.cuda  # CUDA graphs
@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: two KV cache groups
def test_graph_replays_match_eager(tiny_model_dir: Any, arch: str) -> None:
    path = str(tiny_model_dir(arch))
    # 5 prompts with max_num_seqs 8: decode batches of 5 replay the size-8 graph (padded);
    # ragged lengths make the first steps mixed (eager), the later ones graph replays.
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 33, 2, 60)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # float32: a padded replay multiplies 8 rows where eager multiplies 5, and cuBLAS may
    # pick another kernel; in bf16 that rounding difference can flip a near-tie after a
    # few dozen tokens, which says nothing about the graphs.
    options = dict(device="cuda", dtype="float32", max_num_seqs=8, block_size=16, num_blocks=256)
    eager = LLM(path, enforce_eager=True, **options).generate(prompts, params)
    graphed_llm = LLM(path, enforce_eager=False, **options)
    graphs = graphed_llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    graphed = graphed_llm.generate(prompts, params)
    assert graphs.num_replays > 0
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    # One by one: batch size 1 replays the size-1 graph.
    single = graphed_llm.generate(prompts[:1], params)
    assert single[0].token_ids == eager[0].token_ids


@pytest.mark.cuda  # CUDA graphs
def test_draft_model_forwards_replay_graphs(tiny_model_dir: Any) -> None:
    """draft_model speculation on CUDA: the draft's one-token forwards (2..k) replay its
    own captured graphs, and the tokens equal an eager engine's (greedy, self-draft:
    every draft is accepted either way)."""
    path = str(tiny_model_dir("llama"))
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 33)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": path}
    options = dict(
        device="cuda", dtype="float32", max_num_seqs=8, num_blocks=256, speculative_config=spec
    )
    eager = LLM(path, enforce_eager=True, **options).generate(prompts, params)
    graphed_llm = LLM(path, enforce_eager=False, **options)
    drafter = graphed_llm.engine.runner.drafter
    assert drafter is not None and drafter.graphs is not None
    graphed = graphed_llm.generate(prompts, params)
    assert drafter.graphs.num_replays > 0
    assert [o.outputs[0].token_ids for o in graphed] == [o.outputs[0].token_ids for o in eager]
