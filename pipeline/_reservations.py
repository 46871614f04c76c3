"""Budgets and rate limits shared by replicas: each request's reservation, checked and
taken for every scope at once in Redis, settled when the request ends.

Promises:

* one Lua script (`SCRIPT`, run with ``EVALSHA``) does everything: it reserves a request's
  estimated cost on each of its budgets and takes its rate-limit cells, all or nothing;
  settles a request (its reservation released, its actual cost spent, its token estimate
  corrected by its usage); and rebuilds lost counters;
* one call of that script is on the way at a time: a reservation goes out at once when
  none is, else it waits with the others that come meanwhile and they go out together when
  the reply comes; the settlements waiting since the last call go with them. So a request
  costs Redis one round trip at most, and under load many requests share one. A settlement
  waits for the next reservation (or `SETTLE_DELAY` seconds);
* a budget admits a request while what is spent and reserved is under its limit, so what
  a budget's scope spends ends under its limit plus one request's cost; a refusal names the
  budget's scope; a soft limit passed is told in the grant (what remains);
* a rate limit is a cell-rate limit (GCRA) on Redis's clock: `limit` per minute with a
  burst of `burst` seconds' worth; a refusal tells when a retry can be admitted, and every
  answer tells each limit's remaining and reset, as the response headers need;
* a reservation holds a lease: one whose request never settles (a replica that died) is
  released when the lease ends; a settlement counted twice (a retry of a call that timed
  out after Redis ran it) is not;
* every answer but `Refused` is settled by its caller, `Unavailable` included (a call that
  timed out may still run in Redis; a request served while Redis was away counts when it
  is back);
* counters are rebuilt when Redis lost them (restarted without persistence, flushed): the
  script refuses reservations until a rebuild ran (`Unavailable`), elects one caller to run
  it (the ``rebuild`` callable: spent amounts from the ledger), and a settlement whose
  reservation was lost adds its actual cost.

Amounts are integers of `NANOS` per currency unit (exact in Redis; Lua's doubles keep them
exact below $9,000,000 per counter).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from decimal import ROUND_CEILING, ROUND_HALF_EVEN, Decimal
from typing import Any, Literal

from pipeline._redis import Outage
from pipeline._resp import RespClient, Script

__all__ = [
    "NANOS",
    "SCRIPT",
    "SETTLE_DELAY",
    "BudgetCheck",
    "Demand",
    "Granted",
    "RateCheck",
    "RateState",
    "Refused",
    "Reservations",
    "Settlement",
    "Unavailable",
    "nanos",
]

NANOS = 1_000_000_000
"""Counter units per currency unit."""
SETTLE_DELAY = 0.05
"""Seconds a settlement waits for a reservation to share its round trip with."""

_logger = logging.getLogger("chat_pipeline.budgets")


def nanos(amount: Decimal, *, up: bool = False) -> int:
    """`amount` in counter units (rounded up for what is reserved or limited)."""
    scaled = amount * NANOS
    return int(scaled.to_integral_value(ROUND_CEILING if up else ROUND_HALF_EVEN))


SCRIPT = Script(
    r"""
-- KEYS[1] epoch, KEYS[2] leases (zset: token -> end, ms), KEYS[3] lease records (hash),
-- KEYS[4] rebuild election; KEYS[5...] the counters operations name by index.
-- ARGV: one operation each (R: reserve, S: settle, B: rebuild; fields in _reservations.py).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local epoch = redis.call('EXISTS', KEYS[1]) == 1
local function int(x) return string.format('%d', x) end

-- Leases past their end (a request that never settled): release what they reserved.
local ended = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 32)
for _, token in ipairs(ended) do
  local record = redis.call('HGET', KEYS[3], token)
  if record and record ~= 's' then
    local amount = nil
    for part in string.gmatch(record, '[^\n]+') do
      if amount == nil then amount = part else redis.call('HINCRBY', part, 'r', '-' .. amount) end
    end
  end
  redis.call('HDEL', KEYS[3], token)
  redis.call('ZREM', KEYS[2], token)
end

local function rate_info(rates, tats)
  local out = {}
  for r, check in ipairs(rates) do
    local d = tats[r] - now
    if d < 0 then d = 0 end
    local remaining = 0
    if d <= check.tau then remaining = math.floor((check.tau - d) / check.interval) + 1 end
    out[#out + 1] = remaining
    out[#out + 1] = math.ceil(d)
  end
  return out
end

local replies = {}
for n = 1, #ARGV do
  -- One operation an argument: its fields separated by spaces (few arguments to encode).
  local f = {}
  for w in string.gmatch(ARGV[n], '%S+') do f[#f + 1] = w end
  local op = f[1]
  if op == 'R' then
    local token, lease, amount = f[2], tonumber(f[3]), f[4]
    local nb = tonumber(f[5])
    local i = 6
    local budgets = {}
    for b = 1, nb do
      budgets[b] = {key = KEYS[tonumber(f[i])], limit = tonumber(f[i + 1]),
                    soft = tonumber(f[i + 2]), expire = tonumber(f[i + 3])}
      i = i + 4
    end
    local nr = tonumber(f[i])
    i = i + 1
    local rates = {}
    for r = 1, nr do
      rates[r] = {key = KEYS[tonumber(f[i])], interval = tonumber(f[i + 1]),
                  tau = tonumber(f[i + 2]), cost = tonumber(f[i + 3])}
      i = i + 4
    end
    if not epoch then
      local elected = 0
      if redis.call('SET', KEYS[4], '1', 'NX', 'PX', 60000) then elected = 1 end
      replies[n] = {4, elected}
    else
      local refused, left, soft_left = nil, 0, nil
      for b, check in ipairs(budgets) do
        local v = redis.call('HMGET', check.key, 's', 'r')
        local used = (tonumber(v[1]) or 0) + (tonumber(v[2]) or 0)
        if used >= check.limit then
          refused, left = b, check.limit - used
          break
        end
        if check.soft >= 0 and used >= check.soft then
          local remaining = check.limit - used
          if soft_left == nil or remaining < soft_left then soft_left = remaining end
        end
      end
      if refused then
        replies[n] = {2, refused, int(left)}
      else
        local tats, limited, wait = {}, nil, 0
        for r, check in ipairs(rates) do
          local tat = tonumber(redis.call('GET', check.key)) or now
          if tat < now then tat = now end
          tats[r] = tat
          if tat - now > check.tau then
            local w = tat - now - check.tau
            if limited == nil or w > wait then limited, wait = r, w end
          end
        end
        if limited then
          local reply = {3, limited, math.ceil(wait)}
          for _, x in ipairs(rate_info(rates, tats)) do reply[#reply + 1] = x end
          replies[n] = reply
        else
          local record = amount
          for _, check in ipairs(budgets) do
            redis.call('HINCRBY', check.key, 'r', amount)
            if check.expire > 0 then redis.call('EXPIREAT', check.key, check.expire) end
            record = record .. '\n' .. check.key
          end
          if nb > 0 then
            redis.call('HSET', KEYS[3], token, record)
            redis.call('ZADD', KEYS[2], now + lease, token)
          end
          for r, check in ipairs(rates) do
            tats[r] = tats[r] + check.cost * check.interval
            redis.call('SET', check.key, string.format('%.3f', tats[r]),
                       'PX', math.ceil(tats[r] - now + check.tau) + 1000)
          end
          local reply = {1, soft_left and int(soft_left) or false}
          for _, x in ipairs(rate_info(rates, tats)) do reply[#reply + 1] = x end
          replies[n] = reply
        end
      end
    end
  elseif op == 'S' then
    local token, reserved, actual = f[2], f[3], f[4]
    local nb = tonumber(f[5])
    local i = 6
    local record = redis.call('HGET', KEYS[3], token)
    local budgets = {}
    for b = 1, nb do
      budgets[b] = {key = KEYS[tonumber(f[i])], expire = tonumber(f[i + 1])}
      i = i + 2
    end
    local nr = tonumber(f[i])
    i = i + 1
    local rates = {}
    for r = 1, nr do
      rates[r] = {key = KEYS[tonumber(f[i])], interval = tonumber(f[i + 1]),
                  delta = tonumber(f[i + 2])}
      i = i + 3
    end
    if record == 's' then
      replies[n] = {0}  -- settled already (a call sent again)
    else
      for _, check in ipairs(budgets) do
        -- A lease gone (ended, or lost with Redis) reserved nothing here any more.
        if record then redis.call('HINCRBY', check.key, 'r', '-' .. reserved) end
        redis.call('HINCRBY', check.key, 's', actual)
        if check.expire > 0 then redis.call('EXPIREAT', check.key, check.expire) end
      end
      for _, check in ipairs(rates) do
        if check.delta ~= 0 then
          local tat = tonumber(redis.call('GET', check.key))
          if tat then
            tat = tat + check.delta * check.interval
            local ttl = math.ceil(tat - now) + 60000
            if ttl > 1000 then
              redis.call('SET', check.key, string.format('%.3f', tat), 'PX', ttl)
            end
          end
        end
      end
      -- Remembered a minute, so that the same settlement sent again counts once.
      redis.call('HSET', KEYS[3], token, 's')
      redis.call('ZADD', KEYS[2], now + 60000, token)
      replies[n] = {0}
    end
  elseif op == 'B' then
    local nb = tonumber(f[2])
    local i = 3
    for b = 1, nb do
      local key = KEYS[tonumber(f[i])]
      redis.call('HINCRBY', key, 's', f[i + 1])
      local expire = tonumber(f[i + 2])
      if expire > 0 then redis.call('EXPIREAT', key, expire) end
      i = i + 3
    end
    redis.call('SET', KEYS[1], now)
    redis.call('DEL', KEYS[4])
    epoch = true
    replies[n] = {5}
  else
    return redis.error_reply('ERR unknown operation')
  end
end
return replies
"""
)


@dataclass(frozen=True, slots=True)
class BudgetCheck:
    """One budget a request counts against: its counter's Redis key (one per scope and
    period), its limit and soft limit in `NANOS`, and when the counter may expire (unix
    seconds after its period ends; 0: never). `scope` names it in a refusal."""

    key: str
    limit: int
    soft: int | None = None
    expire_at: int = 0
    scope: str = "key"
    wire: str = field(init=False, repr=False, compare=False)
    """Its fields as the script reads them, after its key's index (made once)."""

    def __post_init__(self) -> None:
        soft = -1 if self.soft is None else self.soft
        object.__setattr__(self, "wire", f" {self.limit} {soft} {self.expire_at}")


@dataclass(frozen=True, slots=True)
class RateCheck:
    """One rate limit a request takes cells of: `limit` units (`requests` or `tokens`) a
    minute for `scope`, with a burst of `burst` seconds' worth; `cost` units now."""

    key: str
    limit: int
    cost: int
    unit: Literal["requests", "tokens"] = "requests"
    scope: str = "key"
    burst: float = 1.0
    wire: str = field(default="", repr=False, compare=False)
    """Its interval and tolerance as the script reads them (made once by whoever makes the
    same limit for many requests; else made when encoded)."""

    @property
    def interval(self) -> float:
        """Milliseconds per unit."""
        return 60_000.0 / self.limit

    @property
    def tolerance(self) -> float:
        """How far ahead (ms) the limit may run: the burst."""
        return self.burst * 1000.0


@dataclass(slots=True)
class Demand:
    """What one request asks of its budgets and limits: `amount` (`NANOS`, its estimated
    maximum cost) reserved on each of `budgets`, `rates` taken; `lease` seconds before an
    unsettled reservation is released."""

    budgets: Sequence[BudgetCheck] = ()
    amount: int = 0
    rates: Sequence[RateCheck] = ()
    lease: float = 600.0
    token: str = ""


@dataclass(frozen=True, slots=True)
class RateState:
    """A rate limit's headers: its limit a minute, what could be admitted now, and the
    milliseconds until it is back to its full burst."""

    check: RateCheck
    remaining: int
    reset_ms: int


@dataclass(frozen=True, slots=True)
class Granted:
    """The request is admitted; `soft_remaining` (currency units) when it passed a soft
    limit: what the tightest such budget has left."""

    token: str
    rates: tuple[RateState, ...] = ()
    soft_remaining: Decimal | None = None


@dataclass(frozen=True, slots=True)
class Refused:
    """The request is refused: over `budget` (with what it has left, never above zero), or
    over `rate` (with the milliseconds before a retry can be admitted)."""

    budget: BudgetCheck | None = None
    rate: RateCheck | None = None
    retry_after_ms: int = 0
    rates: tuple[RateState, ...] = ()


@dataclass(frozen=True, slots=True)
class Unavailable:
    """Redis was not asked or did not answer (an outage, or counters being rebuilt): the
    caller fails open or closed."""

    reason: str = "unavailable"


Answer = Granted | Refused | Unavailable


@dataclass(slots=True)
class Settlement:
    """A request's end: its `reserved` amount released and its `actual` cost spent on each
    budget; each token limit corrected by `deltas` (actual - estimated tokens)."""

    demand: Demand
    actual: int
    token_deltas: dict[str, int] = field(default_factory=dict)


_PREFIX = os.urandom(6).hex()
_counter = itertools.count(1)


def new_token() -> str:
    """A reservation's id, unique across replicas in practice."""
    return f"{_PREFIX}{next(_counter):x}"


class _Batch:
    __slots__ = ("answers", "keys", "ops", "reserves", "settles")

    def __init__(self) -> None:
        self.keys: dict[str, int] = {}
        self.ops: list[Any] = []
        self.reserves: list[tuple[Demand, asyncio.Future[Answer]]] = []
        self.settles: list[Settlement] = []

    def key(self, name: str) -> int:
        index = self.keys.get(name)
        if index is None:
            index = self.keys[name] = len(self.keys) + 5
        return index


class Reservations:
    """The reservations and settlements of one process on one Redis (see the module
    docstring). `namespace` prefixes every key; `rebuild` (optional) returns the spent
    amounts to restore per counter key, with their expiry, when Redis lost them; it runs
    `rebuild_delay` seconds after the loss was seen (time for every replica's ledger to
    write what it holds)."""

    def __init__(
        self,
        redis: RespClient,
        *,
        namespace: str = "chat-pipeline",
        rebuild: Callable[[], Awaitable[Sequence[tuple[str, int, int]]]] | None = None,
        rebuild_delay: float = 2.0,
        settle_delay: float = SETTLE_DELAY,
        max_pending: int = 100_000,
        fallback: str = "requests are served without budgets or rate limits",
        retry_interval: float = 1.0,
    ) -> None:
        self.redis = redis
        self.outage = Outage(
            _logger, "budget and rate-limit store (Redis)", fallback, retry_interval
        )
        self.namespace = namespace
        self._fixed = [
            f"{namespace}:epoch",
            f"{namespace}:leases",
            f"{namespace}:lease",
            f"{namespace}:rebuilding",
        ]
        self._rebuild = rebuild
        self.rebuild_delay = rebuild_delay
        self.settle_delay = settle_delay
        self.max_pending = max_pending
        self._batch: _Batch | None = None
        self._scheduled: asyncio.Handle | None = None
        self._soon = False  # the batch goes out at the next turn (not after a delay)
        self._waiting_settles: list[Settlement] = []
        self._pending: set[asyncio.Future[Any]] = set()
        self._rebuilding: asyncio.Task[None] | None = None
        self.calls = 0  # script calls made (each one round trip)

    # -- the operations ----------------------------------------------------------------------

    def key(self, *parts: str) -> str:
        """A counter's Redis key in this namespace."""
        return ":".join((self.namespace, *parts))

    async def reserve(self, demand: Demand) -> Answer:
        """Reserve `demand` (it gets its token): `Granted`, `Refused` or `Unavailable`."""
        if not demand.token:
            demand.token = new_token()
        if self.outage.skipping():
            return Unavailable("outage")
        batch = self._open()
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        batch.reserves.append((demand, future))
        if not self._pending:
            # Nothing on the way: out now (no extra turn of the loop). While a call is on
            # the way, reservations gather and go out together when its reply comes.
            if self._scheduled is not None:
                self._scheduled.cancel()
            self._send()
        # A caller cancelled cancels its own answer only; the call goes on for the others.
        return await future

    def settle(self, settlement: Settlement) -> None:
        """Settle a granted request (sent with the next call, within `settle_delay`)."""
        batch = self._open()
        if len(batch.settles) >= self.max_pending:
            _logger.warning("too many settlements waiting for Redis: the oldest is dropped")
            batch.settles.pop(0)
        batch.settles.append(settlement)
        if self._scheduled is None:
            self._schedule(self.settle_delay)

    async def prepare(self, bound: float = 10.0) -> bool:
        """Make sure the counters exist (a fresh or restarted Redis has them rebuilt now,
        not at a request), within `bound` seconds; whether Redis answered."""
        try:
            async with asyncio.timeout(bound):
                while True:
                    answer = await self.reserve(Demand())
                    if not isinstance(answer, Unavailable):
                        return True
                    if answer.reason != "rebuilding":
                        return False
                    rebuilding = self._rebuilding
                    if rebuilding is not None:
                        await asyncio.wait({rebuilding})
                    else:
                        await asyncio.sleep(0.05)  # another replica rebuilds
        except TimeoutError:
            return False

    async def flush(self) -> None:
        """Send what waits now, and wait for the calls under way (what fails is kept for
        the next call)."""
        if self._batch is not None:
            if self._scheduled is not None:
                self._scheduled.cancel()
            self._send()
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)

    async def aclose(self) -> None:
        await self.flush()
        if self._rebuilding is not None:
            self._rebuilding.cancel()
            await asyncio.gather(self._rebuilding, return_exceptions=True)

    # -- batching ----------------------------------------------------------------------------

    def _open(self) -> _Batch:
        batch = self._batch
        if batch is None:
            batch = self._batch = _Batch()
        return batch

    def _schedule(self, delay: float) -> None:
        if self._scheduled is not None:
            self._scheduled.cancel()
        loop = asyncio.get_running_loop()
        self._soon = delay <= 0
        if self._soon:
            self._scheduled = loop.call_soon(self._send)
        else:
            self._scheduled = loop.call_later(delay, self._send)

    def _send(self) -> None:
        self._scheduled = None
        self._soon = False
        batch, self._batch = self._batch, None
        if batch is None or not (batch.reserves or batch.settles):
            return
        self.calls += 1
        try:
            args = self._encode(batch)
            reply = self.redis.evalsha_soon(SCRIPT, [*self._fixed, *batch.keys], args)
        except Exception as exc:  # nothing was sent: the same as a failed call
            self._failed(batch, exc)
            return
        self._pending.add(reply)
        reply.add_done_callback(lambda done: self._replied(batch, done))

    def _encode(self, batch: _Batch) -> list[str]:
        """One argument per operation, its fields joined by spaces (keys by index)."""
        args: list[str] = []
        key = batch.key
        # Settlements first: what they give back is there for the reservations after them.
        for settlement in batch.settles:
            demand = settlement.demand
            fields = [f"S {demand.token} {demand.amount} {settlement.actual} {len(demand.budgets)}"]
            for budget in demand.budgets:
                fields.append(f"{key(budget.key)} {budget.expire_at}")
            deltas = settlement.token_deltas
            tokens = [rate for rate in demand.rates if rate.key in deltas]
            fields.append(str(len(tokens)))
            for rate in tokens:
                fields.append(f"{key(rate.key)} {rate.interval!r} {deltas[rate.key]}")
            args.append(" ".join(fields))
        for demand, _ in batch.reserves:
            fields = [
                f"R {demand.token} {int(demand.lease * 1000)} {demand.amount} {len(demand.budgets)}"
            ]
            for budget in demand.budgets:
                fields.append(f"{key(budget.key)}{budget.wire}")
            fields.append(str(len(demand.rates)))
            for rate in demand.rates:
                static = rate.wire or f"{rate.interval!r} {rate.tolerance!r}"
                fields.append(f"{key(rate.key)} {static} {rate.cost}")
            args.append(" ".join(fields))
        return args

    def _replied(self, batch: _Batch, reply: asyncio.Future[Any]) -> None:
        self._pending.discard(reply)
        waiting = self._batch
        if waiting is not None and waiting.reserves and not self._pending:
            # What gathered while this call was on the way goes out now.
            if self._scheduled is not None:
                self._scheduled.cancel()
            self._send()
        error = asyncio.CancelledError() if reply.cancelled() else reply.exception()
        if error is not None:
            self._failed(batch, error)
            return
        self.outage.succeeded()
        # The settlements' replies come first (they were sent first).
        replies = reply.result()[len(batch.settles) :]
        for (demand, future), answer in zip(batch.reserves, replies, strict=True):
            if not future.done():
                future.set_result(self._answer(demand, answer))

    def _failed(self, batch: _Batch, error: BaseException) -> None:
        """Redis failed: callers fail open or closed; settlements wait for the next call
        (counted once if this one ran after all)."""
        self.outage.failed(error)
        for _, future in batch.reserves:
            if not future.done():
                future.set_result(Unavailable(type(error).__name__))
        if batch.settles:
            self._requeue(batch.settles)

    def _requeue(self, settles: list[Settlement]) -> None:
        batch = self._open()
        room = self.max_pending - len(batch.settles)
        if room < len(settles):
            _logger.warning(
                "Redis unavailable: %d settlements dropped (their leases release them)",
                len(settles) - max(room, 0),
            )
        batch.settles[:0] = settles[: max(room, 0)]
        if self._scheduled is None:
            # Not at once: Redis just failed; the next reservation or the delay sends them.
            self._schedule(max(self.settle_delay, 1.0))

    def _answer(self, demand: Demand, reply: Any) -> Answer:
        status = int(reply[0])
        if status == 1:
            soft = reply[1]
            rates = _rate_states(demand.rates, reply[2:])
            remaining = None if soft is None else Decimal(int(soft)) / NANOS
            return Granted(demand.token, rates, remaining)
        if status == 2:
            budget = demand.budgets[int(reply[1]) - 1]
            return Refused(budget=budget)
        if status == 3:
            rate = demand.rates[int(reply[1]) - 1]
            return Refused(
                rate=rate, retry_after_ms=int(reply[2]), rates=_rate_states(demand.rates, reply[3:])
            )
        if status == 4:
            if int(reply[1]) == 1:
                self._start_rebuild()
            return Unavailable("rebuilding")
        raise ValueError(f"unexpected reply status {status}")  # pragma: no cover

    # -- rebuilding --------------------------------------------------------------------------

    def _start_rebuild(self) -> None:
        if self._rebuilding is not None and not self._rebuilding.done():
            return
        self._rebuilding = asyncio.get_running_loop().create_task(self._run_rebuild())

    async def _run_rebuild(self) -> None:
        """Restore the counters Redis lost from `rebuild` (the ledger), then let
        reservations in again. On failure the election lapses and another caller tries."""
        _logger.warning(
            "budget counters missing in Redis (restarted or flushed): rebuilding them from the "
            "ledger in %.3g s; reservations wait meanwhile",
            self.rebuild_delay,
        )
        await asyncio.sleep(self.rebuild_delay)
        try:
            spent = list(await self._rebuild()) if self._rebuild is not None else []
            fields = [f"B {len(spent)}"]
            keys = list(self._fixed)
            for index, (key, amount, expire_at) in enumerate(spent):
                keys.append(key)
                fields.append(f"{index + 5} {amount} {expire_at}")
            await self.redis.evalsha(SCRIPT, keys, [" ".join(fields)])
        except Exception as exc:  # the next elected caller tries again
            _logger.warning("rebuilding budget counters failed (%s)", type(exc).__name__)
            return
        _logger.info("budget counters rebuilt (%d counters)", len(spent))


def _rate_states(rates: Sequence[RateCheck], values: Sequence[Any]) -> tuple[RateState, ...]:
    states = []
    for index, rate in enumerate(rates):
        remaining = int(values[2 * index])
        reset = int(values[2 * index + 1])
        states.append(RateState(rate, remaining, reset))
    return tuple(states)


def retry_seconds(milliseconds: int) -> float:
    """A refusal's wait in seconds, never below a millisecond."""
    return max(milliseconds, 1) / 1000.0


def ceil_seconds(milliseconds: int) -> int:
    return max(1, math.ceil(milliseconds / 1000))
