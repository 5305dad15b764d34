"""The scheduler side of our connector in a vLLM server (vLLM's engine-core process): vLLM
asks it how much of a request is loaded; it answers "not known yet" until the engine beside
vLLM's worker (``served.ServedEngine``) has planned the request, then as ``--engine vllm``
does. The plans come over the ``Mailbox``."""

from __future__ import annotations

from typing import Any

from dualpath.vllm.connector import REQUEST_ID_PARAM, ConnectorHost, ConnectorScheduler, PlanView
from dualpath.vllm.served_mailbox import Mailbox

# How long vLLM's loop waits for a plan, once per schedule, when its last step ran nothing,
# instead of running empty steps: a DE waits for its PE's whole prefill, and vLLM's worker
# busy-polls for a second after every step it is sent (its shared-memory queue), so empty
# steps keep a core busy that the engine may share with that PE (measured: a DE's worker at
# 85-95% of a core with 50 ms between empty steps, its PE on the same core starved). Any news
# from the engine (a plan, a cancel) ends the wait at once; a request that is not ours, or
# vLLM's own abort, may wait this long while all of ours wait.
_IDLE_WAIT_S = 5.0
_ADMISSION_WAIT_S = 0.01  # the same, while a planned request has yet to reach vLLM's scheduler


class ServedScheduler(ConnectorScheduler):
    """The scheduler side for requests the front door forwarded: "not known yet" until the
    engine planned one, then as for ``--engine vllm``."""

    def __init__(self, host: ConnectorHost, persists: bool, vllm_engine_id: str) -> None:
        self.views: dict[int, PlanView] = {}  # our request id -> its plan, from the engine
        super().__init__(host, self.views.get)
        self.persists = persists
        self.mailbox = Mailbox(vllm_engine_id, own="scheduler", other="engine")
        self._admitted: dict[str, int] = {}  # vLLM's request id -> ours, once planned
        self._admitted_ids: set[int] = set()  # ours, of the planned requests vLLM holds
        self._was_idle = True  # vLLM's last step ran nothing
        self._has_waited = False  # in this schedule
        self._num_used_blocks = 0

    def _take_mail(self, timeout_s: float = 0.0) -> None:
        for kind, request_id, *fields in self.mailbox.receive(timeout_s):
            if kind == "plan":
                first, num_tokens, persist_from, prompt, cache_salt = fields
                view = PlanView(
                    request_id, first, num_tokens, persist_from, tuple(prompt), cache_salt
                )
                self.views[request_id] = view
            elif kind == "drop":
                self.views.pop(request_id, None)
                self._admitted_ids.discard(request_id)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        request_id = (request.kv_transfer_params or {}).get(REQUEST_ID_PARAM)
        if request_id is None:
            return 0  # not ours: vLLM serves it alone
        self._take_mail()
        if request_id not in self.views and self._was_idle and not self._has_waited:
            self._has_waited = True  # once per schedule, however many requests wait
            # A plan whose request vLLM has not taken in yet: the request is in vLLM's input
            # queue, which only a step ends the wait for. Else wait for the engine's news.
            is_admission_due = any(rid not in self._admitted_ids for rid in self.views)
            self._take_mail(_ADMISSION_WAIT_S if is_admission_due else _IDLE_WAIT_S)
        view = self.views.get(request_id)
        if view is None:
            return None
        mismatch = _mismatch(view, request)
        if mismatch is not None:
            del self.views[request_id]
            self.mailbox.send("refused", request_id, mismatch)
            return 0
        self._admitted[request.request_id] = request_id
        self._admitted_ids.add(request_id)
        return self._num_loadable(view, request, num_computed_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        self._was_idle = scheduler_output.total_num_scheduled_tokens == 0
        self._has_waited = False
        self._take_mail()
        meta = super().build_connector_meta(scheduler_output)
        num_used = sum(len(tracked.block_ids) for tracked in self._tracked.values())
        if num_used != self._num_used_blocks:
            self._num_used_blocks = num_used
            self.mailbox.send("blocks", num_used)
        return meta

    def request_finished(self, request: Any) -> None:
        super().request_finished(request)
        request_id = self._admitted.pop(request.request_id, None)
        if request_id is None:
            return
        self.views.pop(request_id, None)
        self._admitted_ids.discard(request_id)
        reason = request.get_finished_reason()
        if reason is not None and str(reason) != "abort":  # an abort is the front door's
            self.mailbox.send("ended", request_id, list(request.output_token_ids), str(reason))


def _mismatch(view: PlanView, request: Any) -> str | None:
    """Why vLLM's request is not the one placed, if it is not: another prompt, or another cache
    salt (its blocks were read in the placed salt's namespace: loading them into a request of
    another would hand one tenant's KV to another)."""
    request_id = view.request_id
    if view.prompt_token_ids != tuple(request.prompt_token_ids or ()):
        return (
            f"request {request_id}'s prompt at this vLLM server "
            f"({len(request.prompt_token_ids or ())} tokens) is not the one it was placed "
            f"with ({len(view.prompt_token_ids or ())} tokens)"
        )
    if view.cache_salt != (request.cache_salt or None):
        return (
            f"request {request_id}'s cache_salt at this vLLM server is not the one it was "
            "placed with"
        )
    return None
