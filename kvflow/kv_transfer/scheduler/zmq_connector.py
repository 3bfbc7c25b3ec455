"""The zmq connector, scheduler side: a decode instance pulls a prompt's KV from the
prefill instance that computed it (the producer that `kv_transfer_params` names).

Producer (kv_producer): every prompt it completes is handed to its worker, which copies
the blocks out of the paged cache into a buffer and serves them to whoever asks
(kvflow/kv_transfer/worker/zmq_connector.py). Its own blocks are freed as usual when the
request ends, so a consumer that never comes leaks nothing; the buffer drops the
oldest entries past its size.

Consumer (kv_consumer): a request with `kv_transfer_params.remote_address` counts its
whole prompt as loadable, but the last token (it samples from that token's logits):
the proxy sent the prompt to the producer first and waited for its answer, so the
KV is there. The request gets its blocks, then waits for the pull in a state of its
own (remote_loads.py) while the other requests keep running; a failed or timed-out
pull falls back by kv_load_failure_policy.
"""

from __future__ import annotations

from kvflow.kv_transfer.scheduler.connector import KVConnectorScheduler, PromptDone
from kvflow.kv_transfer_config import KVTransferConfig
from kvflow.proto.kv_transfer import KVBlockTransfer, KVConnectorMeta
from kvflow.services.scheduler.request import Request


class ZmqScheduler(KVConnectorScheduler):
    load_is_async = True

    def __init__(
        self, config: KVTransferConfig, block_size: int, failure_policy: str = "recompute"
    ) -> None:
        super().__init__(config, block_size, failure_policy)
        self._loads: list[KVBlockTransfer] = []

    def get_num_new_matched_tokens(self, request: Request, num_local_computed: int) -> int:
        if not self.config.is_consumer or request.sampling_params.prompt_logprobs is not None:
            return 0
        params = request.sampling_params.kv_transfer_params
        if params is None or not params.remote_address or request.num_output_tokens > 0:
            return 0  # nothing named, or resumed after a preemption: computed here
        return max(0, request.num_prompt_tokens - 1 - num_local_computed)

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_local: int, num_external: int
    ) -> None:
        params = request.sampling_params.kv_transfer_params
        assert params is not None and params.remote_address
        first = num_local // self.block_size
        end = -(-(num_local + num_external) // self.block_size)
        keys = self.prompt_keys(request)[first:end]
        transfer = KVBlockTransfer(request.request_id, block_ids[first:end], keys)
        transfer.remote = params.remote_address
        self._loads.append(transfer)
        self.counters.num_loaded_requests += 1
        self.counters.num_loaded_tokens += num_external

    def build_meta(self, prompts_done: list[PromptDone]) -> KVConnectorMeta | None:
        loads, self._loads = self._loads, []
        saves = []
        if self.config.is_producer:
            for done in prompts_done:
                keys = self.prompt_keys(done.request)
                block_ids = done.block_ids[: len(keys)]
                saves.append(KVBlockTransfer(done.request.request_id, block_ids, keys))
                self.counters.num_saved_blocks += len(keys)
        if not loads and not saves:
            return None
        return KVConnectorMeta(loads=loads, saves=saves)
