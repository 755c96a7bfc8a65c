"""The few things the controller needs that p4runtime-shell 0.0.6 does not offer.

Everything else goes through p4runtime-shell's public API (``shell.setup``/``teardown``, its
``P4RuntimeClient`` and entities). This module exists because:

* ``shell.setup`` calls ``sys.exit`` when the server is absent, the arbitration fails or the
  pipeline is rejected, and it only prints whether this client became primary:
  :func:`open_session` turns each failure into :class:`SessionError` with the reason and
  asks the server whether the session is primary.
* ``P4RuntimeClient.write`` sends one batch but decodes a failed batch with
  ``P4RuntimeErrorIterator``, whose ``__next__`` never advances past a per-update status of
  OK (``continue`` without ``self.idx += 1``): a batch where some updates succeed and one
  fails loops forever. tests/test_p4rt.py reproduces it. :class:`BatchWriter` decodes the
  per-update statuses itself, on a channel whose metadata limit holds one status per update
  of a batch of thousands (the client's default channel refuses them).
* p4runtime-shell pins protobuf < 3.21, which on Python 3.11 is the pure-Python runtime:
  building, copying and serialising a job's thousands of lookup entries as messages costs
  about 9x writing them serialized (``thc bench install``). :func:`exact_entity` writes the
  serialized Entity of an exact-match table entry directly (field numbers read from the
  p4runtime descriptors; tests/bmv2/test_controller_offline.py checks it byte for byte
  against protobuf for every table and action), and :class:`BatchWriter` frames serialized
  entities into WriteRequests the same way.
* p4runtime-shell's reads and writes take no deadline: a switch that stops answering
  mid-operation would hold the controller forever. :func:`open_session` gives the client a
  stub on the same channel through an interceptor (:func:`_deadline_interceptor`) that
  bounds every read and write by :data:`RPC_DEADLINE` (the arbitration stream keeps none),
  and :class:`BatchWriter` passes it to its own writes. ``shell.setup``'s own calls (the
  arbitration, reading or pushing the pipeline) come before that stub: :func:`open_session`
  runs it in a daemon thread, waited for a bounded time, so that its stream thread is one
  too and a switch that never answers neither holds the command nor keeps its process.
* the client queues the arbitration updates its stream receives after the handshake, and
  nothing reads them: :func:`primary_taken` does, so that a session another controller
  displaced knows it (the switch takes its writes again once the other closes).
* ``shell.PacketOut`` requires a ``packet_out`` controller header in the P4Info; the THC
  program has none (a RESET is a plain frame injected at the CPU port), so
  :func:`send_raw_packets` queues raw PacketOut messages on the client's stream.

* nothing says whether the session's stream still runs (a switch that restarted ended it):
  :func:`stream_ended` reads the client's receiving thread.
* values given as text (an IPv4 or MAC address, a number) go through the shell's own parser,
  which is not exported: :func:`parse_value` calls it and names a value that does not fit.

Nothing here patches p4runtime-shell's code: ``shell.setup`` itself sets its ``client`` and
``context``, as it does for its interactive users; the one attribute replaced is the
client's ``stub``, on the same channel.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
import time
from functools import lru_cache
from typing import Callable, Iterable, NamedTuple

from thc.lifetime import Terminated

log = logging.getLogger(__name__)

GRPC_OPTIONS = [("grpc.max_metadata_size", 64 << 20),
                ("grpc.absolute_max_metadata_size", 64 << 20),
                ("grpc.max_receive_message_length", 64 << 20)]
"""Large enough for one p4.v1.Error per update of a batch of thousands."""


RPC_DEADLINE = 30.0
"""Seconds one P4Runtime read or write may take before it fails (DEADLINE_EXCEEDED)."""


def _deadline_interceptor(seconds: float):
    """A gRPC interceptor that gives every unary call (and every read's stream) ``seconds``
    where the caller set no timeout."""
    import collections

    import grpc

    class Details(collections.namedtuple("Details", ("method", "timeout", "metadata",
                                                     "credentials", "wait_for_ready",
                                                     "compression")),
                  grpc.ClientCallDetails):
        pass

    class Deadline(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
        def _bounded(self, d):
            return Details(d.method, seconds if d.timeout is None else d.timeout, d.metadata,
                           d.credentials, getattr(d, "wait_for_ready", None),
                           getattr(d, "compression", None))

        def intercept_unary_unary(self, continuation, details, request):
            return continuation(self._bounded(details), request)

        def intercept_unary_stream(self, continuation, details, request):
            return continuation(self._bounded(details), request)
    return Deadline()


class SessionError(RuntimeError):
    """A P4Runtime session could not be opened, or a write was refused as a whole."""


class NoPipeline(SessionError):
    """The device has no forwarding pipeline (no P4 program pushed yet)."""


class UpdateError(NamedTuple):
    index: int
    code: int
    message: str


WRITER_TOP = 1 << 62


def writer_election_id() -> tuple[int, int]:
    """A writing session's election id, taken as it opens: its own (the microsecond, and the
    process), lower than every earlier writer's and above the readers' (0, pid). Its own,
    so that a session whose switch restarted under it has its writes refused there by the
    session that holds the switch now (with one id shared by every writer they were taken);
    lower, so that a second writer finds the first primary and is refused instead of taking
    its place mid-change. Ids come from each host's clock: writers on hosts whose clocks
    disagree, or across a step of the clock back, may order otherwise."""
    return WRITER_TOP - time.time_ns() // 1000, os.getpid()


def _server_ready(grpc_addr: str, timeout: float) -> bool:
    import grpc
    probe = grpc.insecure_channel(grpc_addr)
    try:
        grpc.channel_ready_future(probe).result(timeout=timeout)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        probe.close()


def _is_primary(client) -> bool:
    """An empty WriteRequest: the server checks the election id first (PERMISSION_DENIED
    unless primary) and has nothing to apply. BMv2 does not answer a repeated arbitration,
    and ``shell.setup`` keeps the first answer to itself."""
    import grpc
    from p4.v1 import p4runtime_pb2
    req = p4runtime_pb2.WriteRequest(device_id=client.device_id)
    req.election_id.high, req.election_id.low = client.election_id
    try:
        client.stub.Write(req)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.PERMISSION_DENIED:
            return False
        raise SessionError(f"P4Runtime server refused an empty write: {e.code().name}: "
                           f"{e.details()}") from None
    return True


def open_session(grpc_addr: str, device_id: int, election_id: tuple[int, int] | None,
                 pipeline: tuple[str, str] | None, timeout: float):
    """``shell.setup`` without ``sys.exit``: returns (client, P4Info, is_primary); the
    client's ``election_id`` is ``election_id``, or a writer's of its own
    (:func:`writer_election_id`) taken once the server answers."""
    from p4runtime_sh import shell as sh

    late = _late_setup
    if late is not None and late.is_alive():
        raise SessionError(f"a session setup that overran ({late.name}) still runs in this "
                           f"process, on p4runtime-shell's one client: wait for it to end, or "
                           f"open the session from another process")
    if not _server_ready(grpc_addr, timeout):
        raise SessionError(f"no P4Runtime server at {grpc_addr} answered within {timeout:g} s "
                           f"(is simple_switch_grpc running with --grpc-server-addr "
                           f"{grpc_addr}, and not stopped or overloaded?)")
    election_id = election_id or writer_election_id()
    config = sh.FwdPipeConfig(*pipeline) if pipeline else None
    said = _Said()
    with _on_root(said):
        return _setup(sh, grpc_addr, device_id, election_id, config, timeout, pipeline, said)


def _setup(sh, grpc_addr, device_id, election_id, config, timeout, pipeline, said):
    try:
        # setup prints "You are not the primary client" on stdout, which belongs to the
        # caller (``thc controller counters --json``)
        with contextlib.redirect_stdout(io.StringIO()):
            _bounded(lambda: sh.setup(device_id=device_id, grpc_addr=grpc_addr,
                                      election_id=election_id, config=config, verbose=False),
                     timeout + RPC_DEADLINE, grpc_addr, lambda: close_session(sh.client),
                     lambda: _cut(sh))
    except _SetupOverran:
        raise SessionError(f"the switch at {grpc_addr} took its session's setup (arbitration, "
                           f"{'pushing' if pipeline else 'reading'} the pipeline) past "
                           f"{timeout + RPC_DEADLINE:g} s; is it overloaded or stopped?"
                           ) from None
    except (SystemExit, Exception) as e:
        # a failed setup leaves the client's stream threads running: the process would
        # never exit
        if sh.client is not None:
            try:
                sh.client.tear_down()
            except Exception:  # noqa: BLE001 - the session is already broken
                log.debug("tear_down after a failed setup", exc_info=True)
            sh.client = None
        if isinstance(e, Terminated):   # SIGTERM while waiting: the command ends, as asked
            raise
        reason = "; ".join(said.messages) or ("" if isinstance(e, SystemExit) else str(e))
        if "no forwarding pipeline config" in reason.lower():
            raise NoPipeline(f"the switch at {grpc_addr} has no P4 program for device "
                             f"{device_id} (the server: {reason}): push one (`thc controller "
                             f"push`), or give the device id the switch runs (--device-id)"
                             ) from None
        if "election id already exists" in reason.lower():
            raise SessionError(
                f"another controller session with election id {election_id} is open on "
                f"{grpc_addr} (the server: {reason}); wait for it to finish (a command "
                f"that only reads, such as jobs or counters, may pass another "
                f"--election-id: two that write at once can interleave their changes)"
                ) from None
        if pipeline and "not primary" in reason.lower():
            raise SessionError(
                f"another controller is primary on {grpc_addr}, so this one cannot push a "
                f"program (the server: {reason}); wait for it to finish") from None
        if reason.lower() == "failed to establish session with server":
            # the shell waits 2 s for the arbitration's answer, then says only this (a
            # stream the server ended says why before it)
            raise SessionError(
                f"the switch at {grpc_addr} did not answer the P4Runtime session's arbitration "
                f"in time (the server: {reason}); is it overloaded or stopped?") from None
        what = "pushing the pipeline" if pipeline else "reading the P4Info"
        raise SessionError(
            f"P4Runtime session with device {device_id} at {grpc_addr} failed (arbitration "
            f"or {what}" + (f": {reason}" if reason else "") + f"; does the switch run with "
            f"--device-id {device_id}, and is the program valid?)") from None
    import grpc
    from p4.v1 import p4runtime_pb2_grpc
    sh.client.stub = p4runtime_pb2_grpc.P4RuntimeStub(
        grpc.intercept_channel(sh.client.channel, _deadline_interceptor(RPC_DEADLINE)))
    try:
        primary = _is_primary(sh.client)
    except Exception:
        close_session(sh.client)   # its stream's thread would keep the process alive
        raise
    return sh.client, sh.context.p4info, primary


class _SetupOverran(Exception):
    pass


_late_setup: threading.Thread | None = None
"""A setup :func:`_bounded` gave up on: until it ends it may still set or tear down
p4runtime-shell's module-wide client, so no other session opens in this process."""


def _bounded(call, seconds: float, grpc_addr: str, undo, cut) -> None:
    """``call()`` in a daemon thread, waited for at most ``seconds`` (_SetupOverran, after
    ``cut()``, which ends the call's wait on the switch); what it raised, SystemExit
    included, is raised here. A call that succeeds after that is undone (``undo()``) in its
    thread. A signal that ends the wait (Ctrl-C, SIGTERM) cuts the call as an overrun does:
    its channel left open held the process at exit, in grpc's channel finalizer."""
    global _late_setup
    outcome: list[BaseException] = []
    lock = threading.Lock()
    state = {"done": False, "gave_up": False}

    def run():
        try:
            call()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            outcome.append(e)
        with lock:
            state["done"] = True
            late = state["gave_up"] and not outcome
        if late:
            undo()
    thread = threading.Thread(target=run, name=f"p4runtime-setup {grpc_addr}", daemon=True)
    thread.start()
    try:
        thread.join(seconds)
    finally:
        with lock:
            state["gave_up"] = not state["done"]
        if state["gave_up"]:
            _late_setup = thread
            cut()
    if state["gave_up"]:
        raise _SetupOverran()
    thread.join()
    if outcome:
        raise outcome[0]


def _cut(sh) -> None:
    """Close the channel of a setup that overran, where its client exists: its pending call
    fails at once, and the setup's thread ends instead of holding the process's client."""
    client = sh.client
    if client is not None:
        try:
            client.channel.close()
        except Exception:  # noqa: BLE001 - the setup is abandoned either way
            log.debug("closing an abandoned setup's channel", exc_info=True)


@contextlib.contextmanager
def _on_root(handler: logging.Handler):
    """``handler`` on the root logger while p4runtime-shell runs: the shell logs through
    logging's module functions, which give a root logger that has no handler a stderr one
    for good (``logging.basicConfig``), and every later record of the shell's is printed."""
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)


def quiet_shell():
    """Around a p4runtime-shell call: its log records go nowhere, and leave the root logger
    as it was (:func:`_on_root`); the controller reports the shell's errors itself."""
    return _on_root(logging.NullHandler())


class _Said(logging.Handler):
    """The errors p4runtime-shell logged during setup: it logs the server's reason for a
    failed arbitration or push, then exits without it."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


CLOSE_WAIT = 5.0
"""Seconds a closing session waits for the switch to end its stream before cancelling it."""


def stream_ended(client) -> bool:
    """Whether the session's stream has ended (its receiving thread stopped); False where
    the client has none to tell (a test's stand-in)."""
    stream = getattr(client, "stream_recv_thread", None)
    return stream is not None and not stream.is_alive()


def can_see_arbitration(client) -> bool:
    """Whether the client queues the arbitration updates :func:`primary_taken` reads."""
    return hasattr(client, "stream_in_q")


def parse_value(text: str, bitwidth: int) -> bytes:
    """``text`` (a number, IPv4 or MAC address) as p4runtime-shell parses it for a field of
    ``bitwidth`` bits; ValueError saying which: it does not fit, or it is none of those."""
    from p4runtime_sh.bytes_utils import parse_value as shell_parse
    from p4runtime_sh.utils import UserError
    try:
        return shell_parse(text, bitwidth)
    except UserError as e:
        raise ValueError(f"does not fit {bitwidth} bits: {e}") from None
    except ValueError as e:   # the shell's MAC parser raises it for a part that is no byte
        raise ValueError(f"is not a number, an IPv4 or a MAC address ({e})") from None


def primary_taken(client) -> tuple[int, int] | None:
    """The election id of another controller that became primary since the session's setup,
    from the arbitration updates its stream received (the server sends every session one
    whenever the primary changes; the shell queues them, unread, after its handshake), or
    None. Once taken, a switch returns to the session when that controller closes, and its
    writes are accepted again: only the updates tell that another one held it."""
    import queue
    own = tuple(client.election_id)
    updates = client.stream_in_q["arbitration"]
    while True:
        try:
            msg = updates.get_nowait()
        except queue.Empty:
            return None
        if msg is None:   # the stream ended: the session's other check names it
            return None
        other = (msg.arbitration.election_id.high, msg.arbitration.election_id.low)
        if other != own:
            return other


ARBITRATION_WAIT = 0.25
"""Seconds :func:`primary_taken_by_now` waits for the switch's answer once its round trip
came back. PI's server (BMv2's) answers no arbitration that repeats a session's election
id, so there the wait is a settle: the updates sent before the round trip's answer have
reached the client by then, and wait only for the stream's thread to queue them."""

ROUND_TRIP_WAIT = 2.0
"""Seconds the round trip may take; one that did not come back (a slow or stopped switch)
orders nothing, and the answer or updates are then waited for as long."""


def primary_taken_by_now(client, timeout: float = ARBITRATION_WAIT) -> tuple[int, int] | None:
    """:func:`primary_taken` after a round trip: the session sends its arbitration again,
    then a Capabilities request on the same channel, and reads the stream's arbitration
    messages up to one naming it or for ``timeout`` (:data:`ROUND_TRIP_WAIT` where the
    request failed or took longer: at most twice that in all). An update the switch sent
    before that request's answer (one HTTP/2 connection, in order), such as a primary that
    came and went during the change's last write, is then seen, where :func:`primary_taken`
    alone reads only what has arrived. None where none named another, or the stream ended
    (the session's other check names that)."""
    import queue

    import grpc
    from p4.v1 import p4runtime_pb2
    taken = primary_taken(client)
    if not hasattr(client, "stream_out_q"):
        return taken
    own = tuple(client.election_id)
    req = p4runtime_pb2.StreamMessageRequest()
    req.arbitration.device_id = client.device_id
    req.arbitration.election_id.high, req.arbitration.election_id.low = own
    if getattr(client, "role_name", None) is not None:
        req.arbitration.role.name = client.role_name
    client.stream_out_q.put(req)
    if hasattr(client, "stub"):
        try:
            client.stub.Capabilities(p4runtime_pb2.CapabilitiesRequest(),
                                     timeout=ROUND_TRIP_WAIT)
        except grpc.RpcError:
            timeout = ROUND_TRIP_WAIT
    updates = client.stream_in_q["arbitration"]
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            msg = updates.get(timeout=left)
        except queue.Empty:
            break
        if msg is None:
            break
        other = (msg.arbitration.election_id.high, msg.arbitration.election_id.low)
        if other == own:
            break
        taken = taken or other
    return taken


def close_session(client) -> None:
    """``shell.teardown`` for the session :func:`open_session` opened, bounded: teardown
    waits for the switch to end the session's stream, which a switch that stopped answering
    never does (and the stream's thread would keep the process alive), so after
    :data:`CLOSE_WAIT` the stream is cancelled."""
    from p4runtime_sh import shell as sh
    if sh.client is not client or client is None:
        return
    client.stream_out_q.put(None)
    client.stream_recv_thread.join(CLOSE_WAIT)
    if client.stream_recv_thread.is_alive():
        logging.disable(logging.CRITICAL)   # the shell logs the cancelled stream as an error
        try:
            client.stream.cancel()
            client.stream_recv_thread.join(CLOSE_WAIT)
        finally:
            logging.disable(logging.NOTSET)
    with quiet_shell():
        sh.teardown()


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def canonical_bytes(n: int) -> bytes:
    """P4Runtime's canonical byte string of a non-negative integer: no leading zero bytes."""
    return n.to_bytes(max(1, (n.bit_length() + 7) // 8), "big")


def _number(message, field: str) -> int:
    return message.DESCRIPTOR.fields_by_name[field].number


def _wire_tags():
    """Tag bytes of the fields written here, from the p4runtime descriptors."""
    from p4.v1 import p4runtime_pb2 as pb

    def tag(message, field, wire_type):
        return _varint(_number(message, field) << 3 | wire_type)
    return {
        "update.type": tag(pb.Update, "type", 0),
        "update.entity": tag(pb.Update, "entity", 2),
        "entity.table_entry": tag(pb.Entity, "table_entry", 2),
        "table.id": tag(pb.TableEntry, "table_id", 0),
        "table.match": tag(pb.TableEntry, "match", 2),
        "table.action": tag(pb.TableEntry, "action", 2),
        "match.id": tag(pb.FieldMatch, "field_id", 0),
        "match.exact": tag(pb.FieldMatch, "exact", 2),
        "exact.value": tag(pb.FieldMatch.Exact, "value", 2),
        "table_action.action": tag(pb.TableAction, "action", 2),
        "action.id": tag(pb.Action, "action_id", 0),
        "action.params": tag(pb.Action, "params", 2),
        "param.id": tag(pb.Action.Param, "param_id", 0),
        "param.value": tag(pb.Action.Param, "value", 2),
        "request.updates": tag(pb.WriteRequest, "updates", 2),
    }


_TAGS: dict[str, bytes] = {}


def _tags() -> dict[str, bytes]:
    if not _TAGS:
        _TAGS.update(_wire_tags())
    return _TAGS


def _field(tag: bytes, payload: bytes) -> bytes:
    return tag + _varint(len(payload)) + payload


def exact_entity(table_id: int, matches, action_id: int | None = None, params=()) -> bytes:
    """The serialized p4runtime Entity holding one exact-match table entry: ``matches`` and
    ``params`` are (id, canonical value bytes) in id order, as protobuf writes them."""
    if action_id is None:
        t = _tags()
        return _field(t["entity.table_entry"], t["table.id"] + _varint(table_id) + b"".join(
            _match_piece(fid, value) for fid, value in matches))
    return exact_entities(table_id, action_id, [(matches, params)])[0]


def exact_entities(table_id: int, action_id: int, rows) -> list[bytes]:
    """:func:`exact_entity` of every (matches, params) row of one table and action, with the
    pieces rows share serialized once: a job's lookup tables hold tens of thousands of
    entries made of a few hundred distinct (field, value) pieces."""
    t = _tags()
    head = t["table.id"] + _varint(table_id)
    act_head = t["action.id"] + _varint(action_id)
    entity, table_action, action = t["entity.table_entry"], t["table.action"], \
        t["table_action.action"]
    out = []
    for matches, params in rows:
        act = act_head + b"".join(_param_piece(pid, value) for pid, value in params)
        out.append(_field(entity, head + b"".join(_match_piece(fid, value)
                                                  for fid, value in matches)
                          + _field(table_action, _field(action, act))))
    return out


@lru_cache(maxsize=1 << 12)
def _match_piece(field_id: int, value: bytes) -> bytes:
    t = _tags()
    return _field(t["table.match"], t["match.id"] + _varint(field_id)
                  + _field(t["match.exact"], _field(t["exact.value"], value)))


@lru_cache(maxsize=1 << 14)
def _param_piece(param_id: int, value: bytes) -> bytes:
    t = _tags()
    return _field(t["action.params"], t["param.id"] + _varint(param_id)
                  + _field(t["param.value"], value))


def read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return value, pos


def entity_table_id(entity: bytes) -> int:
    """The table id of a serialized Entity that :func:`exact_entity` wrote."""
    t = _tags()
    pos = len(t["entity.table_entry"])
    _, pos = read_varint(entity, pos)
    return read_varint(entity, pos + len(t["table.id"]))[0]


class BatchWriter:
    """WriteRequests of many updates with per-update error reporting (see module doc)."""

    def __init__(self, grpc_addr: str, device_id: int, election_id: tuple[int, int]):
        import grpc
        from p4.v1 import p4runtime_pb2
        self.device_id, self.election_id = device_id, election_id
        self.channel = grpc.insecure_channel(grpc_addr, options=GRPC_OPTIONS)
        self._write = self.channel.unary_unary(
            "/p4.v1.P4Runtime/Write", request_serializer=None,
            response_deserializer=p4runtime_pb2.WriteResponse.FromString)

    def close(self) -> None:
        self.channel.close()

    def write(self, update_type: int, entities: list[bytes], batch: int,
              before: Callable[[], object] = lambda: None) -> list[UpdateError]:
        """Send one update of ``update_type`` per serialized Entity, ``batch`` per
        WriteRequest; return the failed ones by index into ``entities``. ``before`` runs
        before each WriteRequest and raises to send no more of them."""
        import grpc
        from p4.v1 import p4runtime_pb2
        head = p4runtime_pb2.WriteRequest(device_id=self.device_id)
        head.election_id.high, head.election_id.low = self.election_id
        head = head.SerializeToString()
        t = _tags()
        kind = t["update.type"] + _varint(update_type)
        failed = []
        for start in range(0, len(entities), batch):
            before()
            body = b"".join(_field(t["request.updates"], kind + _field(t["update.entity"], e))
                            for e in entities[start:start + batch])
            try:
                self._write(head + body, timeout=RPC_DEADLINE)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise SessionError(f"the switch answered no P4Runtime write within "
                                       f"{RPC_DEADLINE:g} s; what it applied stands (this "
                                       f"batch's updates may or may not be among it): run "
                                       f"the command again once it answers") from None
                errors = update_errors(e)
                if errors is None:
                    raise SessionError(f"P4Runtime write failed: {e.code().name}: "
                                       f"{e.details()}") from None
                failed += [UpdateError(start + i, c, m) for i, c, m in errors]
        return failed


def update_errors(rpc_error) -> list[UpdateError] | None:
    """The failed updates of a rejected WriteRequest, from its ``grpc-status-details-bin``
    (one p4.v1.Error per update, OK for those applied); None when the error is not
    per-update (wrong election id, server gone, ...)."""
    import grpc
    from google.rpc import code_pb2, status_pb2
    from p4.v1 import p4runtime_pb2
    if rpc_error.code() != grpc.StatusCode.UNKNOWN:
        return None
    details = None
    for key, value in rpc_error.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            details = status_pb2.Status.FromString(value).details
    if not details:
        return None
    out = []
    for i, any_error in enumerate(details):
        err = p4runtime_pb2.Error()
        if not any_error.Unpack(err):
            return None
        if err.canonical_code != code_pb2.OK:
            out.append(UpdateError(i, err.canonical_code, err.message))
    return out


def send_raw_packets(client, payloads: Iterable[bytes]) -> int:
    """Queue PacketOut messages without packet_out metadata on the client's stream."""
    from p4.v1 import p4runtime_pb2
    n = 0
    for payload in payloads:
        msg = p4runtime_pb2.StreamMessageRequest()
        msg.packet.payload = payload
        client.stream_out_q.put(msg)
        n += 1
    return n
