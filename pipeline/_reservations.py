"""Budgets and rate limits shared by replicas: each request's reservation, checked and
taken for every scope at once in Redis, settled when the request ends.

One Lua script reserves a request's estimated cost on each of its budgets and takes its
rate-limit cells, all or nothing, and settles it when it ends; a request costs Redis one
round trip at most.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from decimal import ROUND_CEILING, ROUND_HALF_EVEN, Decimal
from typing import Any, Literal

from pipeline._redis import Outage
from pipeline._resp import RespClient, Script

__all__ = [
    "NANOS",
    "REBUILD_POLL",
    "SCRIPT",
    "SETTLE_DELAY",
    "BudgetCheck",
    "Demand",
    "Granted",
    "Limits",
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
REBUILD_POLL = 0.05
"""Seconds `Reservations.prepare` waits before asking again while another replica rebuilds
the counters."""

_logger = logging.getLogger("chat_pipeline.budgets")


def nanos(amount: Decimal, *, up: bool = False) -> int:
    """`amount` in counter units (rounded up for what is reserved or limited)."""
    scaled = amount * NANOS
    return int(scaled.to_integral_value(ROUND_CEILING if up else ROUND_HALF_EVEN))


SCRIPT = Script(
    r"""
-- KEYS[1] epoch, KEYS[2] leases (zset: token -> end, ms), KEYS[3] lease records (hash),
-- KEYS[4] rebuild election; KEYS[5...] the counters: each operation's own, from its `base`
-- (budgets first, then rate limits; a key may come again for another operation).
-- ARGV: one operation each (R: reserve, S: settle, B: rebuild; fields in _reservations.py),
-- after 'T ms' when the caller keeps the time (its `clock`) in place of Redis's.
local first, now = 1, nil
if string.byte(ARGV[1] or '', 1) == 84 then
  now, first = tonumber(string.sub(ARGV[1], 3)), 2
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
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
for n = first, #ARGV do
  -- One operation an argument: its fields separated by spaces (few arguments to encode).
  local f = {}
  for w in string.gmatch(ARGV[n], '%S+') do f[#f + 1] = w end
  local slot = n - first + 1
  local op = f[1]
  if op == 'R' then
    -- R token lease amount base tokens nb (limit soft expire)*nb nr (interval tau cost)*nr;
    -- a rate's cost 't' is the request's tokens.
    local token, lease, amount = f[2], tonumber(f[3]), f[4]
    local k, tokens = tonumber(f[5]), tonumber(f[6])
    local nb = tonumber(f[7])
    local i = 8
    local budgets = {}
    for b = 1, nb do
      budgets[b] = {key = KEYS[k], limit = tonumber(f[i]), soft = tonumber(f[i + 1]),
                    expire = tonumber(f[i + 2])}
      i = i + 3
      k = k + 1
    end
    local nr = tonumber(f[i])
    i = i + 1
    local rates = {}
    for r = 1, nr do
      local cost = tokens
      if f[i + 2] ~= 't' then cost = tonumber(f[i + 2]) end
      rates[r] = {key = KEYS[k], interval = tonumber(f[i]), tau = tonumber(f[i + 1]), cost = cost}
      i = i + 3
      k = k + 1
    end
    if not epoch then
      local elected = 0
      if redis.call('SET', KEYS[4], '1', 'NX', 'PX', 60000) then elected = 1 end
      replies[slot] = {4, elected}
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
        replies[slot] = {2, refused, int(left)}
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
          replies[slot] = reply
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
          replies[slot] = reply
        end
      end
    end
  elseif op == 'S' then
    -- S token reserved actual base delta nb (expire)*nb nr (interval tokens)*nr; `delta`
    -- (actual - estimated tokens) corrects each rate whose `tokens` is 1.
    local token, reserved, actual = f[2], f[3], f[4]
    local k, delta = tonumber(f[5]), tonumber(f[6])
    local nb = tonumber(f[7])
    local i = 8
    local record = redis.call('HGET', KEYS[3], token)
    local budgets = {}
    for b = 1, nb do
      budgets[b] = {key = KEYS[k], expire = tonumber(f[i])}
      i = i + 1
      k = k + 1
    end
    local nr = tonumber(f[i])
    i = i + 1
    local rates = {}
    for r = 1, nr do
      rates[r] = {key = KEYS[k], interval = tonumber(f[i]), tokens = f[i + 1] == '1'}
      i = i + 2
      k = k + 1
    end
    if record == 's' then
      replies[slot] = {0}  -- settled already (a call sent again)
    else
      for _, check in ipairs(budgets) do
        -- A lease gone (ended, or lost with Redis) reserved nothing here any more.
        if record then redis.call('HINCRBY', check.key, 'r', '-' .. reserved) end
        redis.call('HINCRBY', check.key, 's', actual)
        if check.expire > 0 then redis.call('EXPIREAT', check.key, check.expire) end
      end
      if delta ~= 0 then
        for _, check in ipairs(rates) do
          if check.tokens then
            local tat = tonumber(redis.call('GET', check.key))
            if tat then
              tat = tat + delta * check.interval
              local ttl = math.ceil(tat - now) + 60000
              if ttl > 1000 then
                redis.call('SET', check.key, string.format('%.3f', tat), 'PX', ttl)
              end
            end
          end
        end
      end
      -- Remembered a minute, so that the same settlement sent again counts once.
      redis.call('HSET', KEYS[3], token, 's')
      redis.call('ZADD', KEYS[2], now + 60000, token)
      replies[slot] = {0}
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
    replies[slot] = {5}
  else
    return redis.error_reply('ERR unknown operation')
  end
end
return replies
"""
)


def _bulk(data: bytes) -> bytes:
    """`data` as a bulk string of the Redis protocol."""
    return b"$%d\r\n%s\r\n" % (len(data), data)


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


@dataclass(frozen=True, slots=True)
class RateCheck:
    """One rate limit a request takes cells of: `limit` units (`requests` or `tokens`) a
    minute for `scope`, with a burst of `burst` seconds' worth; `cost` units a request (None:
    one request, or the request's tokens)."""

    key: str
    limit: int
    cost: int | None = None
    unit: Literal["requests", "tokens"] = "requests"
    scope: str = "key"
    burst: float = 1.0

    @property
    def interval(self) -> float:
        """Milliseconds per unit."""
        return 60_000.0 / self.limit

    @property
    def tolerance(self) -> float:
        """How far ahead (ms) the limit may run: the burst."""
        return self.burst * 1000.0


class Limits:
    """The budgets and rate limits a caller's requests count against, encoded once for the
    script (make one per caller and keep it). `memo` is for what a user of the limits
    derives from them once (the gateway's header names)."""

    __slots__ = ("budgets", "keys", "keys_resp", "memo", "rates", "reserve_wire", "settle_wire")

    def __init__(self, budgets: Sequence[BudgetCheck] = (), rates: Sequence[RateCheck] = ()):
        self.budgets = tuple(budgets)
        self.rates = tuple(rates)
        self.keys = tuple(b.key for b in self.budgets) + tuple(r.key for r in self.rates)
        self.keys_resp = b"".join(_bulk(key.encode()) for key in self.keys)
        reserve = [str(len(self.budgets))]
        settle = [str(len(self.budgets))]
        for budget in self.budgets:
            soft = -1 if budget.soft is None else budget.soft
            reserve.append(f"{budget.limit} {soft} {budget.expire_at}")
            settle.append(str(budget.expire_at))
        reserve.append(str(len(self.rates)))
        settle.append(str(len(self.rates)))
        for rate in self.rates:
            tokens = rate.unit == "tokens"
            cost = ("t" if tokens else "1") if rate.cost is None else str(rate.cost)
            reserve.append(f"{rate.interval!r} {rate.tolerance!r} {cost}")
            settle.append(f"{rate.interval!r} {int(tokens)}")
        self.reserve_wire = " ".join(reserve)
        self.settle_wire = " ".join(settle)
        self.memo: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"Limits(budgets={len(self.budgets)}, rates={len(self.rates)})"


_NO_LIMITS = Limits()


class Demand:
    """What one request asks of its budgets and limits: `amount` (`NANOS`, its estimated
    maximum cost) reserved on each budget, its rate-limit cells taken (`tokens`, its
    estimated tokens, for the token limits); `lease` seconds before an unsettled reservation
    is released. `limits` (else made of `budgets` and `rates`) is what it counts against."""

    __slots__ = ("amount", "lease", "lease_ms", "limits", "token", "tokens")

    def __init__(
        self,
        budgets: Sequence[BudgetCheck] = (),
        amount: int = 0,
        rates: Sequence[RateCheck] = (),
        lease: float = 600.0,
        token: str = "",
        *,
        tokens: int = 0,
        limits: Limits | None = None,
    ) -> None:
        if limits is None:
            limits = Limits(budgets, rates) if budgets or rates else _NO_LIMITS
        self.limits = limits
        self.amount = amount
        self.tokens = tokens
        self.lease = lease
        self.lease_ms = int(lease * 1000)
        self.token = token

    @property
    def budgets(self) -> tuple[BudgetCheck, ...]:
        return self.limits.budgets

    @property
    def rates(self) -> tuple[RateCheck, ...]:
        return self.limits.rates

    def __repr__(self) -> str:
        return f"Demand({self.limits!r}, amount={self.amount}, tokens={self.tokens})"


@dataclass(frozen=True, slots=True)
class RateState:
    """A rate limit's headers: its limit a minute, what could be admitted now, and the
    milliseconds until it is back to its full burst."""

    check: RateCheck
    remaining: int
    reset_ms: int


class Granted:
    """The request is admitted; `soft_remaining` (currency units) when it passed a soft
    limit: what the tightest such budget has left. `values`: each rate limit's remaining
    and reset (ms), in the order of `limits.rates` (`rates` reads them as `RateState`s)."""

    __slots__ = ("limits", "soft_remaining", "token", "values")

    def __init__(
        self,
        token: str,
        limits: Limits = _NO_LIMITS,
        values: Sequence[int] = (),
        soft_remaining: Decimal | None = None,
    ) -> None:
        self.token = token
        self.limits = limits
        self.values = values
        self.soft_remaining = soft_remaining

    @property
    def rates(self) -> tuple[RateState, ...]:
        return _rate_states(self.limits.rates, self.values)

    def __repr__(self) -> str:
        return f"Granted({self.token!r}, soft_remaining={self.soft_remaining})"


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


class Settlement:
    """A request's end: its `demand`'s reserved amount released and its `actual` cost
    (`NANOS`) spent on each budget; each token limit corrected by `token_delta` (actual -
    estimated tokens)."""

    __slots__ = ("actual", "demand", "token_delta")

    def __init__(self, demand: Demand, actual: int, token_delta: int = 0) -> None:
        self.demand = demand
        self.actual = actual
        self.token_delta = token_delta


_PREFIX = os.urandom(6).hex()
_counter = itertools.count(1)


def new_token() -> str:
    """A reservation's id, unique across replicas in practice."""
    return f"{_PREFIX}{next(_counter):x}"


def reserve_op(demand: Demand, base: int) -> str:
    """The script's argument reserving `demand`, its keys from ``KEYS[base]``."""
    return (
        f"R {demand.token} {demand.lease_ms} {demand.amount} {base} {demand.tokens} "
        f"{demand.limits.reserve_wire}"
    )


def settle_op(settlement: Settlement, base: int) -> str:
    """The script's argument settling `settlement`, its keys from ``KEYS[base]``."""
    demand = settlement.demand
    return (
        f"S {demand.token} {demand.amount} {settlement.actual} {base} "
        f"{settlement.token_delta} {demand.limits.settle_wire}"
    )


class _Batch:
    __slots__ = ("reserves", "settles")

    def __init__(self) -> None:
        self.reserves: list[tuple[Demand, asyncio.Future[Answer]]] = []
        self.settles: list[Settlement] = []


class Reservations:
    """The reservations and settlements of one process on one Redis (see the module
    docstring). `namespace` prefixes every key; `rebuild` (optional) returns the spent
    amounts to restore per counter key, with their expiry, when Redis lost them; it runs
    `rebuild_delay` seconds after the loss was seen (time for every replica's ledger to
    write what it holds). `clock` (seconds; see the property) is for tests."""

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
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.redis = redis
        self.outage = Outage(
            _logger, "budget and rate-limit store (Redis)", fallback, retry_interval
        )
        self.clock = clock
        self.namespace = namespace
        self._fixed = [
            f"{namespace}:epoch",
            f"{namespace}:leases",
            f"{namespace}:lease",
            f"{namespace}:rebuilding",
        ]
        # The start of every call: the command, the script, and the fixed keys after the
        # count of keys (which varies).
        self._head = _bulk(b"EVALSHA") + _bulk(SCRIPT.sha.encode())
        self._fixed_resp = b"".join(_bulk(key.encode()) for key in self._fixed)
        self._rebuild = rebuild
        self.rebuild_delay = rebuild_delay
        self.settle_delay = settle_delay
        self.max_pending = max_pending
        self._batch: _Batch | None = None
        self._flusher: asyncio.TimerHandle | None = None
        self._inflight = 0  # script calls on the way
        self._due = False  # the settle timer fired while a call was on the way
        self._idle: list[asyncio.Future[None]] = []  # `flush` callers waiting for them
        self._rebuilding: asyncio.Task[None] | None = None
        self.calls = 0  # script calls made (each one round trip)

    @property
    def clock(self) -> Callable[[], float] | None:
        """The time (seconds) of the rate limits, the leases and the outage's retry interval:
        None (the default) is Redis's own clock (``TIME``: one clock for every replica) and
        `time.monotonic` for the outage. A test gives one (also to a running gateway's
        reservations) to freeze or advance the time."""
        return self._clock

    @clock.setter
    def clock(self, clock: Callable[[], float] | None) -> None:
        self._clock = clock
        self.outage.clock = time.monotonic if clock is None else clock

    def _leading_args(self) -> list[str]:
        """The script's arguments before its operations: the time in milliseconds when
        `clock` keeps it, else none (the script reads Redis's)."""
        clock = self._clock
        return [] if clock is None else [f"T {int(clock() * 1000)}"]

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
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Answer] = loop.create_future()
        batch = self._batch
        if batch is None:
            batch = self._batch = _Batch()
        batch.reserves.append((demand, future))
        if not self._inflight:
            # Nothing on the way: out now (no extra turn of the loop). While a call is on
            # the way, reservations gather and go out together when its reply comes.
            self._send(loop)
        # A caller cancelled cancels its own answer only; the call goes on for the others.
        return await future

    def settle(self, settlement: Settlement) -> None:
        """Settle a granted request (sent with the next call, within `settle_delay`)."""
        batch = self._batch
        if batch is None:
            batch = self._batch = _Batch()
        if len(batch.settles) >= self.max_pending:
            _logger.warning("too many settlements waiting for Redis: the oldest is dropped")
            batch.settles.pop(0)
        batch.settles.append(settlement)
        if self._flusher is None:
            loop = asyncio.get_running_loop()
            self._flusher = loop.call_later(self.settle_delay, self._flush_settles, loop)

    async def prepare(self, bound: float = 10.0) -> bool:
        """Make sure the counters exist (a fresh or restarted Redis has them rebuilt now,
        not at a request), within `bound` seconds; whether Redis answered. A rebuild run
        here is awaited to its end; False at once while an outage is skipped (a test moves
        `clock` past the retry interval first)."""
        try:
            async with asyncio.timeout(bound):
                while True:
                    answer = await self.reserve(Demand())
                    if not isinstance(answer, Unavailable):
                        return True
                    if answer.reason != "rebuilding":
                        return False
                    rebuilding = self._rebuilding
                    if rebuilding is not None and not rebuilding.done():
                        await asyncio.wait({rebuilding})
                    else:
                        # Another replica was elected (an earlier rebuild of ours is over):
                        # its end is told to nobody here, so ask Redis again in a moment.
                        await asyncio.sleep(REBUILD_POLL)
        except TimeoutError:
            return False

    async def flush(self) -> None:
        """Send what waits now, and wait for the calls under way (what fails is kept for
        the next call)."""
        loop = asyncio.get_running_loop()
        if self._batch is not None:
            self._send(loop)
        if self._inflight:
            idle: asyncio.Future[None] = loop.create_future()
            self._idle.append(idle)
            await idle

    async def aclose(self) -> None:
        await self.flush()
        if self._flusher is not None:
            self._flusher.cancel()
            self._flusher = None
        if self._rebuilding is not None:
            self._rebuilding.cancel()
            await asyncio.gather(self._rebuilding, return_exceptions=True)

    # -- batching ----------------------------------------------------------------------------

    def _flush_settles(self, loop: asyncio.AbstractEventLoop) -> None:
        """The settle timer, every `settle_delay` while settlements wait: those no
        reservation took meanwhile go out on their own, or with the reply of the call on
        the way (so a token limit's estimate is corrected that soon, not after a whole
        other delay: the other replicas' requests are refused meanwhile); it stops when
        none waits."""
        self._flusher = None
        batch = self._batch
        if batch is None or not batch.settles:
            return
        if self._inflight:
            self._due = True
        elif not self.outage.skipping():
            self._send(loop)
        self._flusher = loop.call_later(self.settle_delay, self._flush_settles, loop)

    def _send(self, loop: asyncio.AbstractEventLoop) -> None:
        self._due = False
        batch, self._batch = self._batch, None
        if batch is None or not (batch.reserves or batch.settles):
            return
        self.calls += 1
        try:
            command = self._command(batch)
        except Exception as exc:  # nothing was sent: the same as a failed call
            self._failed(batch, exc)
            return
        self._inflight += 1

        def replied(reply: Any, error: BaseException | None) -> None:
            self._replied(batch, loop, reply, error)

        self.redis.evalsha_then(SCRIPT, command, replied, loop)

    def _command(self, batch: _Batch) -> bytes:
        """The batch's ``EVALSHA``: one argument per operation, its fields joined by spaces;
        each operation's keys after the fixed ones, from its `base` (1-based)."""
        keys = [self._fixed_resp]
        ops = self._leading_args()
        count = len(self._fixed)
        # Settlements first: what they give back is there for the reservations after them.
        for settlement in batch.settles:
            limits = settlement.demand.limits
            ops.append(settle_op(settlement, count + 1))
            keys.append(limits.keys_resp)
            count += len(limits.keys)
        for demand, _ in batch.reserves:
            limits = demand.limits
            ops.append(reserve_op(demand, count + 1))
            keys.append(limits.keys_resp)
            count += len(limits.keys)
        number = b"%d" % count
        # The operations are ASCII (ids, numbers): framed as text, encoded once.
        framed = "".join([f"${len(op)}\r\n{op}\r\n" for op in ops]).encode()
        return b"".join(
            (
                b"*%d\r\n" % (3 + count + len(ops)),
                self._head,
                b"$%d\r\n%s\r\n" % (len(number), number),
                *keys,
                framed,
            )
        )

    def _replied(
        self,
        batch: _Batch,
        loop: asyncio.AbstractEventLoop,
        reply: Any,
        error: BaseException | None,
    ) -> None:
        self._inflight -= 1
        if error is not None:
            self._failed(batch, error)
        else:
            self.outage.succeeded()
        waiting = self._batch
        if (
            waiting is not None
            and (waiting.reserves or (self._due and waiting.settles))
            and not self._inflight
        ):
            if self.outage.skipping():
                # Redis just failed: the reservations that gathered meanwhile are answered
                # now (their settlements wait), not sent to wait out another bound.
                for _, future in waiting.reserves:
                    if not future.done():
                        future.set_result(Unavailable("outage"))
                waiting.reserves = []
            else:
                # What gathered while this call was on the way goes out now.
                self._send(loop)
        if error is None:
            try:
                # The settlements' replies come first (they were sent first).
                answers = [
                    self._answer(demand, answer)
                    for (demand, _), answer in zip(
                        batch.reserves, reply[len(batch.settles) :], strict=True
                    )
                ]
            except Exception as exc:  # a reply not of this script's shape: Redis failed us
                batch.settles = []  # they ran
                self._failed(batch, exc)
            else:
                for (_, future), answer in zip(batch.reserves, answers, strict=True):
                    if not future.done():
                        future.set_result(answer)
        if not self._inflight and self._idle:
            idle, self._idle = self._idle, []
            for waiter in idle:
                if not waiter.done():
                    waiter.set_result(None)

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
        batch = self._batch
        if batch is None:
            batch = self._batch = _Batch()
        room = self.max_pending - len(batch.settles)
        if room < len(settles):
            _logger.warning(
                "Redis unavailable: %d settlements dropped (their leases release them)",
                len(settles) - max(room, 0),
            )
        batch.settles[:0] = settles[: max(room, 0)]
        if self._flusher is None:
            # Not at once: Redis just failed; the next reservation or the timer sends them
            # (not while the outage is skipped).
            loop = asyncio.get_running_loop()
            self._flusher = loop.call_later(self.settle_delay, self._flush_settles, loop)

    def _answer(self, demand: Demand, reply: Any) -> Answer:
        status = reply[0]
        if status == 1:
            soft = reply[1]
            remaining = None if soft is None else Decimal(int(soft)) / NANOS
            return Granted(demand.token, demand.limits, reply[2:], remaining)
        if status == 2:
            return Refused(budget=demand.limits.budgets[int(reply[1]) - 1])
        if status == 3:
            rates = demand.limits.rates
            return Refused(
                rate=rates[int(reply[1]) - 1],
                retry_after_ms=int(reply[2]),
                rates=_rate_states(rates, reply[3:]),
            )
        if status == 4:
            if int(reply[1]) == 1:
                self._start_rebuild()
            return Unavailable("rebuilding")
        raise ValueError(f"unexpected reply status {status}")

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
            await self.redis.evalsha(SCRIPT, keys, [*self._leading_args(), " ".join(fields)])
        except Exception as exc:  # the next elected caller tries again
            _logger.warning("rebuilding budget counters failed (%s)", type(exc).__name__)
            return
        _logger.info("budget counters rebuilt (%d counters)", len(spent))


def _rate_states(rates: Sequence[RateCheck], values: Sequence[Any]) -> tuple[RateState, ...]:
    return tuple(
        RateState(rate, int(values[2 * index]), int(values[2 * index + 1]))
        for index, rate in enumerate(rates)
    )
