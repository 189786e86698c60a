"""The engine thread of ``etude serve``: one thread owns the `Engine` and steps it.

HTTP handlers run on the asyncio event loop; the engine runs on its own thread, so a decode step
never blocks the event loop and the event loop never touches the engine. They meet at a command
queue (submit, abort, swap weights, stop) that the engine thread drains before every step, and
at per-request sinks: after a step, each request's new tokens go to its sink (which the HTTP
side makes thread-safe with ``loop.call_soon_threadsafe``).

A weight swap (``swap_weights``) takes a ready state dict (read and checked off this thread)
and copies it into the model between two steps; requests in flight continue on the new
weights, and their generations report the version of their first token.

An exception inside a step fails every request in flight (their sinks get it) and aborts them;
the loop keeps serving new requests.

Not here: several engines (data parallel replicas), weight swaps that wait for in-flight
requests to drain.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from etude.engine import Engine, SamplingParams
from etude.engine.engine import StepOutput

Sink = Callable[[StepOutput | BaseException], None]


@dataclass(eq=False)
class Ticket:
    """A submitted request, as the HTTP side knows it."""

    sink: Sink
    request_id: int | None = None
    cancelled: bool = False


class EngineLoop:
    """Steps one engine on a daemon thread (see the module docstring)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._sinks: dict[int, Ticket] = {}
        self._thread = threading.Thread(target=self._run, name="etude-engine", daemon=True)
        self.num_running = 0
        self.num_waiting = 0
        self.num_steps = 0
        self.num_failed_steps = 0

    @property
    def in_flight(self) -> int:
        """Requests the engine holds (running or waiting) after the last command or step."""
        return self.num_running + self.num_waiting

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join(timeout=30)

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, priority: int, sink: Sink
    ) -> Ticket:
        ticket = Ticket(sink=sink)
        self._commands.put(("submit", ticket, prompt_ids, params, priority))
        return ticket

    def abort(self, ticket: Ticket) -> None:
        ticket.cancelled = True
        self._commands.put(("abort", ticket))

    def swap_weights(self, state: Mapping[str, torch.Tensor], version: int) -> Future[int]:
        """Copy ``state`` into the model between steps; the future holds the new version."""
        done: Future[int] = Future()
        self._commands.put(("swap", state, version, done))
        return done

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while True:
            try:
                command = self._commands.get(block=self.engine.idle, timeout=None)
            except queue.Empty:
                command = None
            while command is not None:
                if command[0] == "stop":
                    self._fail_all(RuntimeError("the server is shutting down"))
                    return
                self._handle(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if not self.engine.idle:
                self._step()
            self.num_running, self.num_waiting = self.engine.num_running, self.engine.num_waiting

    def _handle(self, command: tuple[Any, ...]) -> None:
        kind = command[0]
        if kind == "submit":
            _, ticket, prompt_ids, params, priority = command
            if ticket.cancelled:
                return
            try:
                ticket.request_id = self.engine.submit(prompt_ids, params, priority=priority)
            except ValueError as error:
                ticket.sink(error)
                return
            self._sinks[ticket.request_id] = ticket
        elif kind == "abort":
            ticket = command[1]
            if ticket.request_id is not None and self._sinks.pop(ticket.request_id, None):
                self.engine.abort(ticket.request_id)
        elif kind == "swap":
            _, state, version, done = command
            try:
                with torch.no_grad():
                    self.engine.model.load_state_dict(dict(state), strict=True)
                self.engine.policy_version = int(version)
            except Exception as error:  # checked before; report rather than kill the thread
                done.set_exception(error)
            else:
                done.set_result(int(version))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:  # one bad step must not stop the server
            self.num_failed_steps += 1
            self._fail_all(error)
            return
        self.num_steps += 1
        for out in outputs:
            ticket = self._sinks.get(out.request_id)
            if ticket is None:
                continue
            if out.generation is not None:
                del self._sinks[out.request_id]
            ticket.sink(out)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, ticket in list(self._sinks.items()):
            self.engine.abort(request_id)
            ticket.sink(error)
        self._sinks.clear()
