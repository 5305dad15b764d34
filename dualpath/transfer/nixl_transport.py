"""``Transport`` over NIXL (PyPI ``nixl-cu12``) with its UCX backend.

One NIXL agent per transport, named like the transport. A registered buffer is one NIXL
registration (DRAM for host arrays and CPU tensors, VRAM for CUDA tensors); a ``write`` or
``read`` is one NIXL transfer request whose descriptor list has one entry per region, so a
layer of many Layer Blocks is one batched request.

What UCX does underneath (UCX 1.23 as bundled in nixl-cu12 1.5.1): on one host without GPUs it
moves bytes with CMA (``process_vm_writev``: same user, ptrace allowed) and uses TCP on the
loopback for control; the post itself copies and returns DONE, releasing the GIL. Across hosts
it uses TCP, or RDMA (InfiniBand/RoCE, also straight from/to GPU memory) where present, and the
post returns at once. The bundled UCX has no posix/sysv shared-memory transport, so
``UCX_TLS=sm`` fails; leave ``UCX_TLS`` unset (an empty value also fails) or name transports
that exist here, e.g. ``tcp,cma,self``.

Measured here (2 vCPUs, ``dualpath bench transfer``): CMA costs some 30-50 us per region on
top of ~3 GB/s, so coalesced regions matter on one host. UCX notices a closed or dead peer
asynchronously: across processes the next post failed at once here, but within one process
writes right after the peer's close still succeeded for a few ms. So engines must agree (over
the control channel) before a buffer that a peer may still write to is freed. CUDA tensors
register as VRAM (untested here: no GPU); create the transport after the engine has set its
CUDA device.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
from nixl_cu12 import _api as nixl_api
from nixl_cu12 import _bindings as nixl_bindings
from nixl_cu12 import nixl_agent, nixl_agent_config

from dualpath.errors import PeerUnavailable, TransferError
from dualpath.transfer.transport import BufferDescriptor, TransferHandle, TransferOp, Transport

# The progress thread's poll() timeout when idle (see NixlTransport); 1 ms costs ~2% of a core.
PROGRESS_WAIT_US = 1000
_config_lock = threading.Lock()


@contextlib.contextmanager
def _progress_wait(wait_us: int) -> Iterator[None]:
    """While ``nixl_agent`` is built, its agent config keeps ``wait_us`` as the progress
    thread's delay whatever the wrapper writes there (it writes 0: busy polling)."""
    if wait_us < 0:
        raise ValueError(f"progress_wait_us must be >= 0, got {wait_us}")
    base = nixl_bindings.nixlAgentConfig
    if getattr(nixl_api, "nixlBind", None) is not nixl_bindings or not hasattr(base, "pthrDelay"):
        logger.warning("this NIXL builds its agent differently: progress thread delay left as is")
        yield
        return
    delay = base.pthrDelay  # pybind11's field descriptor

    class _Config(base):
        @property
        def pthrDelay(self) -> int:  # noqa: N802 -- NIXL's field name
            return delay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:  # noqa: N802
            delay.__set__(self, wait_us)

    with _config_lock:
        nixl_api.nixlBind.nixlAgentConfig = _Config
        try:
            yield
        finally:
            nixl_api.nixlBind.nixlAgentConfig = base


if TYPE_CHECKING:
    from dualpath.transfer.transport import Buffer

logger = logging.getLogger(__name__)

# Every error class the bindings raise; none shares a base class below Exception.
_NIXL_ERRORS = tuple(
    getattr(nixl_bindings, name)
    for name in dir(nixl_bindings)
    if name.startswith("nixl") and name.endswith("Error")
)


@contextlib.contextmanager
def _nixl_errors(what: str) -> Iterator[None]:
    """Translate NIXL's exceptions once, at the library boundary."""
    try:
        yield
    except nixl_bindings.nixlRemoteDisconnectError as exc:
        raise PeerUnavailable(f"{what}: the peer disconnected ({exc})") from exc
    except nixl_bindings.nixlNotFoundError as exc:
        raise TransferError(
            f"{what}: a buffer is not registered, or the peer's metadata predates it "
            f"(connect again with fresh metadata) ({exc})"
        ) from exc
    except _NIXL_ERRORS as exc:
        raise TransferError(f"{what}: {type(exc).__name__} {exc}") from exc


class NixlTransport(Transport):
    """A NIXL agent with the UCX backend; see ``Transport`` for the contract."""

    def __init__(
        self, name: str, *, num_threads: int = 0, progress_wait_us: int = PROGRESS_WAIT_US
    ) -> None:
        """``num_threads``: UCX worker threads; 0 lets NIXL choose (one).

        ``progress_wait_us``: how long NIXL's UCX progress thread sleeps in ``poll()`` when no
        event wakes it. The thread must run -- the target side of a transfer progresses
        only there -- but ``nixl_agent`` sets this to 0, which makes the thread spin a whole
        core per agent even when idle; events still wake it at once.
        """
        super().__init__(name)
        config = nixl_agent_config(backends=["UCX"], num_threads=num_threads)
        with _nixl_errors(f"creating NIXL agent {name!r}"), _progress_wait(progress_wait_us):
            self._agent = nixl_agent(name, config)
        if "UCX" not in self._agent.backends:
            raise TransferError(f"NIXL agent {name!r} has no UCX backend (plugin missing)")
        self._unreleased: list[Any] = []  # cancelled requests NIXL could not free yet

    def metadata(self) -> bytes:
        self._check_open()
        with _nixl_errors(f"metadata of {self.name!r}"):
            return self._agent.get_agent_metadata()

    def _register(self, descriptor: BufferDescriptor, buffer: Buffer) -> Any:
        with _nixl_errors(f"registering {descriptor}"):
            return self._agent.register_memory(
                [(descriptor.address, descriptor.num_bytes, descriptor.device_id, "")],
                descriptor.mem_type,
            )

    def _connect(self, peer_name: str, peer_metadata: bytes) -> None:
        what = f"{self.name!r} connecting to {peer_name!r}"
        with _nixl_errors(what):
            try:
                loaded_name = self._agent.add_remote_agent(peer_metadata)
            except nixl_bindings.nixlNotAllowedError:
                # A peer restarted under a known name: NIXL keeps the old connection until
                # the name is dropped. (Fresh metadata of a live peer just loads again.)
                self._agent.remove_remote_agent(peer_name)
                loaded_name = self._agent.add_remote_agent(peer_metadata)
        loaded_name = loaded_name.decode() if isinstance(loaded_name, bytes) else loaded_name
        if loaded_name != peer_name:
            if loaded_name not in self._peer_names:  # do not cut a peer we already use
                with _nixl_errors(what):
                    self._agent.remove_remote_agent(loaded_name)
            raise ValueError(f"{what}: the metadata is agent {loaded_name!r}'s")

    def _post(
        self,
        op: TransferOp,
        peer_name: str,
        local: BufferDescriptor,
        remote: BufferDescriptor,
        regions: np.ndarray,
    ) -> Any:
        local_descs = _xfer_descs(local, regions[:, 0], regions[:, 2])
        remote_descs = _xfer_descs(remote, regions[:, 1], regions[:, 2])
        what = f"{op.value} of {len(regions)} regions to {peer_name!r}"
        with _nixl_errors(what):
            request = self._agent.initialize_xfer(
                op.value,
                self._agent.get_xfer_descs(local_descs, local.mem_type),
                self._agent.get_xfer_descs(remote_descs, remote.mem_type),
                peer_name,
            )
        try:
            with _nixl_errors(what):
                status = self._agent.transfer(request)
        except TransferError:
            self._release(request)
            raise
        if status == "ERR":
            self._release(request)
            raise TransferError(f"{what}: NIXL could not post it")
        return request

    def _poll(self, handle: TransferHandle, state: Any) -> bool:
        try:
            with _nixl_errors(f"transfer {handle}"):
                status = self._agent.check_xfer_state(state)
        except TransferError:
            self._release(state)
            raise
        if status == "PROC":
            return False
        self._release(state)  # done or failed: free the request either way
        if status == "ERR":
            raise TransferError(f"transfer {handle} failed (the peer may be gone)")
        return True

    def _abort(self, state: Any) -> None:
        self._release(state)  # NIXL cancels a request released in flight

    def _release(self, request: Any) -> None:
        try:
            self._agent.release_xfer_handle(request)
        except _NIXL_ERRORS as exc:
            logger.warning("NIXL could not release %s yet (%s); retrying at close", request, exc)
            self._unreleased.append(request)

    def _close(self) -> None:
        for request in self._unreleased:
            with contextlib.suppress(*_NIXL_ERRORS):
                self._agent.release_xfer_handle(request)
        for peer_name in sorted(self._peer_names):
            with contextlib.suppress(*_NIXL_ERRORS):
                self._agent.remove_remote_agent(peer_name)
        for registration in self._buffer_id_to_registration.values():
            with contextlib.suppress(*_NIXL_ERRORS):
                self._agent.deregister_memory(registration.backend_state)
        self._buffer_id_to_registration.clear()
        self._agent = None  # the C++ agent (and its UCX workers) go with the last reference


def _xfer_descs(
    descriptor: BufferDescriptor, offsets_bytes: np.ndarray, sizes_bytes: np.ndarray
) -> np.ndarray:
    """NIXL's ``[n, 3]`` uint64 descriptor rows: (address, length, device id)."""
    rows = np.empty((len(offsets_bytes), 3), dtype=np.uint64)
    rows[:, 0] = descriptor.address + offsets_bytes
    rows[:, 1] = sizes_bytes
    rows[:, 2] = descriptor.device_id
    return rows
