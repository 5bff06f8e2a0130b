"""Waiting queues: FCFS (a deque) and priority (a heap on (priority, arrival time)), and the
fair-share queue around them that serves tenants (API keys) in turn."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from pagedllm.request import Request, RequestStatus


class RequestQueue(Protocol):
    def add(self, request: Request) -> None: ...
    def prepend(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    """First come, first served; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """Lowest ``priority`` value first, then earliest arrival (vLLM's convention)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = 0  # tie-breaker so Requests are never compared

    def add(self, request: Request) -> None:
        self._counter += 1
        heapq.heappush(self._heap, (request.priority, request.arrival_time, self._counter, request))

    prepend = add  # a preempted request's own key already puts it where it belongs

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap))


def _policy_queue(policy: str) -> RequestQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()


class FairShareQueue:
    """One policy queue per tenant (``Request.tenant``, an API key's name); tenants take turns.

    The next request is the head of the tenant that comes first by: its head's priority (the
    priority policy only), a preempted head before a fresh one (it was running), then the tenant
    served longest ago (never served: first; ties: the tenant queued first). So a tenant with a thousand
    queued requests delays another tenant's single request by at most one admission, while each
    tenant's own requests keep the policy's order. With one tenant this is the policy queue itself.
    Iteration is tenant by tenant, not in serving order.
    """

    def __init__(self, policy: str) -> None:
        self._policy = policy
        self._queues: dict[str | None, RequestQueue] = {}  # only tenants with queued requests
        self._last_served: dict[str | None, int] = {}  # tenant -> its latest pop's serial
        self._num_served = 0
        self._len = 0

    def add(self, request: Request) -> None:
        self._queue_of(request.tenant).add(request)
        self._len += 1

    def prepend(self, request: Request) -> None:
        self._queue_of(request.tenant).prepend(request)
        self._len += 1

    def peek(self) -> Request:
        return self._queues[self._next_tenant()].peek()

    def pop(self) -> Request:
        tenant = self._next_tenant()
        request = self._queues[tenant].pop()
        self._num_served += 1
        self._last_served[tenant] = self._num_served
        self._drop_if_empty(tenant)
        self._len -= 1
        return request

    def remove(self, request: Request) -> None:
        self._queues[request.tenant].remove(request)
        self._drop_if_empty(request.tenant)
        self._len -= 1

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        return (request for queue in list(self._queues.values()) for request in queue)

    def _queue_of(self, tenant: str | None) -> RequestQueue:
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = _policy_queue(self._policy)
        return queue

    def _drop_if_empty(self, tenant: str | None) -> None:
        if not len(self._queues[tenant]):
            del self._queues[tenant]

    def _next_tenant(self) -> str | None:
        if not self._queues:
            raise IndexError("peek/pop from an empty queue")
        return min(self._queues, key=self._turn)  # min keeps the first of equals: arrival order

    def _turn(self, tenant: str | None) -> tuple[int, bool, int]:
        head = self._queues[tenant].peek()
        priority = head.priority if self._policy == "priority" else 0
        return priority, head.status != RequestStatus.PREEMPTED, self._last_served.get(tenant, 0)


def create_request_queue(policy: str) -> RequestQueue:
    """The scheduler's waiting queue: ``policy`` (fcfs | priority) within each tenant, tenants in turn."""
    return FairShareQueue(policy)
