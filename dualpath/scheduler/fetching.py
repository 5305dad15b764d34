"""When each engine group fetches (SPEC §6): the one fetch driver of the runtime and the simulator.

Leaders *pull*: a group fetches at its ticks, every ``fetch_interval_s`` (the runtime: the
leader's report; the simulator: a grid), and when idle. Work reaches a group two ways: a
submit wakes every PE group, a PE placement every DE group (a DE freeing memory wakes its own).
A woken group has one fetch pending until it fetches; the driver decides when:

    **The idle rule.** With ``fetch_when_idle``, a woken group that is idle fetches at once;
    any other one at its next tick. A group is idle when its engines hold no work and it has
    been given none since its last report: that report is then exact until it is given work,
    so a fetch made from it now is the fetch its leader would make.

The runtime always fetches when idle: an idle engine reports only every
``report_keepalive_s``, and a request on an idle cluster must not wait for it. The simulator
does where it stands for the runtime (local-profile runs); on the paper's hardware it keeps to
the grid, as the paper's leaders do.

The driver knows nothing of snapshots or the policy: it calls ``fetch_now(group)`` (the caller
fetches at once, or queues a fetch for now) or ``fetch_at_tick(group)`` (the caller arranges
the group's next tick; the runtime's ticks come on their own). Each fetch, however it came,
starts with ``start_fetch``.

    driver = FetchDriver(prefill_groups, decode_groups, fetch_when_idle=True,
                         fetch_now=..., fetch_at_tick=...)
    driver.wake_prefill()              # a submit
    driver.start_fetch(group)          # the group's fetch begins: nothing pending any more
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar


class FetchingGroup(Protocol):
    """What the driver reads and writes of a group."""

    is_fetch_pending: bool

    def is_idle(self) -> bool:
        """No engine holds work, and none was given since the group's last report."""
        ...


GroupT = TypeVar("GroupT", bound=FetchingGroup)


class FetchDriver(Generic[GroupT]):
    """Pending fetches, and the idle rule above; see the module docstring."""

    __slots__ = (
        "prefill_groups",
        "decode_groups",
        "fetch_when_idle",
        "_fetch_now",
        "_fetch_at_tick",
        "_every_prefill_fetch_pending",
        "_every_decode_fetch_pending",
    )

    def __init__(
        self,
        prefill_groups: Sequence[GroupT],
        decode_groups: Sequence[GroupT],
        *,
        fetch_when_idle: bool,
        fetch_now: Callable[[GroupT], None],
        fetch_at_tick: Callable[[GroupT], None],
    ) -> None:
        self.prefill_groups = list(prefill_groups)
        self.decode_groups = list(decode_groups)
        self.fetch_when_idle = fetch_when_idle
        self._fetch_now = fetch_now
        self._fetch_at_tick = fetch_at_tick
        # True once every PE (DE) group has a fetch pending, until one of them fetches: a
        # submit (a PE placement) then has no group to wake, and skips the loop over them.
        self._every_prefill_fetch_pending = False
        self._every_decode_fetch_pending = False

    def wake_prefill(self) -> None:
        """A request waits for a PE: every PE group fetches."""
        if self._every_prefill_fetch_pending:
            return
        for group in self.prefill_groups:
            if not group.is_fetch_pending:  # (the check request_fetch makes, without a call)
                self.request_fetch(group)
        self._every_prefill_fetch_pending = True

    def wake_decode(self) -> None:
        """A request waits for a DE: every DE group fetches."""
        if self._every_decode_fetch_pending:
            return
        for group in self.decode_groups:
            if not group.is_fetch_pending:
                self.request_fetch(group)
        self._every_decode_fetch_pending = True

    def request_fetch(self, group: GroupT) -> None:
        """Work may wait for ``group``: it fetches at once if idle (the idle rule), else at its
        next tick; nothing more if a fetch is pending already."""
        if group.is_fetch_pending:
            return
        group.is_fetch_pending = True
        if self.fetch_when_idle and group.is_idle():
            self._fetch_now(group)
        else:
            self._fetch_at_tick(group)

    def fetches_at_once(self, group: GroupT) -> bool:
        """Whether a fetch pending for ``group`` is due now rather than at its next tick: the
        idle rule, for a group that became idle after it was woken."""
        return group.is_fetch_pending and self.fetch_when_idle and group.is_idle()

    def start_fetch(self, group: GroupT, is_prefill: bool) -> None:
        """``group``'s fetch begins: none is pending for it any more."""
        group.is_fetch_pending = False
        if is_prefill:
            self._every_prefill_fetch_pending = False
        else:
            self._every_decode_fetch_pending = False
