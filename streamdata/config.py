"""Tunables, as small frozen dataclasses; the only module that reads environment variables."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from streamdata.errors import SpecError

__all__ = ["OBJECT_MAX_REQUESTS", "PRESIGN_LIFETIME_MAX", "UNIT_WINDOW", "Cache", "Fetch", "FetchConfig",
           "Retry", "env_int", "env_setdefault", "env_snapshot", "env_str", "freeze_at_fork", "lite_http",
           "stage_times"]

MiB = 1 << 20

# Formats' own defaults for fields that no FetchConfig, environment variable or option set
# (FetchConfig.resolve). Parquet/Arrow units (row groups, record batches) are smaller than
# shards; 16 in flight is the value they have always had here, the byte budget bounds memory
# either way. ObjectDataset fetches a whole batch's objects at once.
UNIT_WINDOW = 16
OBJECT_MAX_REQUESTS = 64
# S3 refuses a SigV4 presigned URL signed for longer than 7 days (FetchConfig.presign_lifetime)
PRESIGN_LIFETIME_MAX = 7 * 24 * 3600


def env_str(name: str, default: str | None = None) -> str | None:
    """Read ``name`` from the environment (the one place the package does so)."""
    value = os.environ.get(name)
    return default if value in (None, "") else value


def env_setdefault(name: str, value: str) -> str:
    """``name``'s value, set to ``value`` first if unset (for a library that reads it at import)."""
    return os.environ.setdefault(name, value)


def env_snapshot(names: Iterable[str]) -> dict[str, str | None]:
    """The raw values of ``names`` (``None`` where unset, ``""`` kept): what a client built now would see."""
    return {name: os.environ.get(name) for name in names}


def lite_http() -> bool:
    """LITE-HTTP (``store.http1``): LITE-S3's GETs go over streamdata's own HTTP/1.1 client, so no process
    imports aiohttp for them. ``STREAMDATA_LITE_HTTP=0`` puts them back on aiohttp (the A/B of
    benchmarks/startup.py; a way out if a server needs what only aiohttp does)."""
    return env_str("STREAMDATA_LITE_HTTP", "1") != "0"


def freeze_at_fork() -> bool:
    """INHERITED-HEAP (``_alloc``): a forked child moves what it inherited out of its garbage
    collector's sight at once. ``STREAMDATA_FREEZE_AT_FORK=0`` leaves the child's collector as
    Python has it."""
    return env_str("STREAMDATA_FREEZE_AT_FORK", "1") != "0"


def stage_times() -> bool:
    """Each reader times its stages (``metrics.StageClock``; ``loader.metrics()``).
    ``STREAMDATA_STAGE_TIMES=0`` leaves the clock out of the pass (the A/B of
    benchmarks/metrics_overhead.py); read at each pass's start, in the reader."""
    return env_str("STREAMDATA_STAGE_TIMES", "1") != "0"


def env_int(name: str, default: int | None = None) -> int | None:
    value = env_str(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise SpecError(f"environment variable {name}={value!r} is not an integer") from None


@dataclass(frozen=True, kw_only=True)
class Fetch:
    """How each reader keeps bytes in flight: ``sd.TarDataset(spec, fetch=sd.Fetch(window=8))``.
    Every field as :class:`FetchConfig`'s of the same name; ``None``: not given (its
    ``STREAMDATA_*`` variable where set, else the default)."""

    window: int | None = None
    part_size: int | None = None
    first_part: int | None = None
    max_requests: int | None = None
    byte_budget: int | None = None
    byte_budget_max: int | None = None
    autotune: bool | None = None
    tune_from: Any = None
    presign_lifetime: int | None = None
    max_requests_per_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class Retry:
    """How a failed request is tried again: ``retry=sd.Retry(deadline=600)``. ``deadline``:
    seconds a part is retried for (``FetchConfig.retry_deadline``); ``retries``, ``backoff``,
    ``backoff_cap``, ``timeout`` as :class:`FetchConfig`'s; ``None``: not given."""

    deadline: float | None = None
    retries: int | None = None
    backoff: float | None = None
    backoff_cap: float | None = None
    timeout: float | None = None


@dataclass(frozen=True, kw_only=True)
class Cache:
    """The node's disk cache: ``cache=sd.Cache(dir="/local/cache", limit=200 << 30)``. ``dir`` and
    ``limit``: ``FetchConfig.cache_dir`` and ``cache_limit`` (``STREAMDATA_CACHE_DIR`` and
    ``STREAMDATA_CACHE_LIMIT`` where not given)."""

    dir: str | None = None
    limit: int | None = None


# each group's keyword, class and fields by FetchConfig's names
_GROUPS: dict[str, tuple[type, dict[str, str]]] = {
    "fetch": (Fetch, {f.name: f.name for f in dataclasses.fields(Fetch)}),
    "retry": (Retry, {"deadline": "retry_deadline", "retries": "retries", "backoff": "backoff",
                      "backoff_cap": "backoff_cap", "timeout": "timeout"}),
    "cache": (Cache, {"dir": "cache_dir", "limit": "cache_limit"}),
}
_GROUP_OF = {flat: (group, field) for group, (_, names) in _GROUPS.items() for field, flat in names.items()}


@dataclass(frozen=True)
class FetchConfig:
    """How a worker's prefetcher keeps bytes in flight.

    window:       shards ahead of the one being parsed whose bytes may be requested.
    part_size:    bytes per ranged GET; a shard larger than this is fetched as several
                  concurrent parts (and parsing starts on the first).
    first_part:   size of the first part of a reader's first shard: small, so the first
                  batch costs one round trip and a short transfer, while the rest arrives.
    max_requests: concurrent GETs per worker.
    byte_budget:  bytes fetched or in flight but not yet consumed; the fetcher holds at
                  most ``max(byte_budget, one part)``. 64 MiB: enough in flight for 100 ms
                  one-way delay at this machine's rate, while a first epoch page-faults in
                  half as much fresh memory as with 128 MiB (benchmarks/README.md, budget A/B).
                  The budget a pass starts with: it grows where it costs the reader time.
    byte_budget_max: the most the byte budget grows to, the reader's memory cap (BUDGET-GROWTH,
                  ``budget``; AUTOTUNE, ``tune``): only
                  where the pass's first two first bytes took 100 ms or more, or the
                  reader waited for a part the budget had held back and latency made it
                  wait (S3's presigned and LITE-S3 GETs, which tell a part's first byte). ``None``: twice
                  ``byte_budget`` (128 MiB); ``byte_budget`` itself: no growth.
    retry_deadline: seconds a failed part (or size lookup) is retried for, counted from its
                  first attempt (waits for a slot under READER-THROTTLE, ``client``, do not
                  count); no new attempt starts after it. 300 s: training jobs run for days
                  and a storage blip of seconds or a minute of throttling must not end them,
                  while a bucket that is really gone still fails within minutes, not hours.
    retries:      optional cap on attempts after the first (``None``: by deadline only);
                  ``0`` never retries.
    backoff:      base of the back-off: before retry ``n`` (from 0) a part sleeps
                  ``uniform(0, min(backoff_cap, backoff * 2**n))`` ("full jitter": retries
                  of many parts and many workers spread out instead of arriving together).
    backoff_cap:  the longest back-off sleep.
    timeout:      seconds for one request before it counts as failed (and is retried).
    cache_dir:    a local directory where fetched shards (and Parquet/Arrow byte ranges) are
                  kept as they stream, and read from on later epochs (``streamdata.fetch.cache``);
                  ``None`` (the default): no cache. Safe to share between every worker and
                  rank of a node.
    cache_limit:  bytes the cache directory may hold (least recently used entries are evicted);
                  ``None``: no limit but the disk's (a full disk degrades to streaming).
    presign_lifetime: seconds an S3 presigned GET URL is signed for (``X-Amz-Expires``;
                  PRESIGN-LIFETIME in ``store.presigned``): whole seconds, 1 to 604800 (7 days,
                  S3's longest). A URL is re-signed once half of it has passed, or sooner where
                  the credentials that signed it expire sooner. 900 s (15 min): well under the
                  hour that temporary credentials typically live, so a URL leaked into a log or
                  an error message is worth little.
    autotune:     AUTOTUNE (``fetch.tune``): each reader's window, request limit, byte budget
                  and part size grow where they cost the reader time, within their bounds:
                  ``window``, ``max_requests`` and ``part_size`` as set are the most they reach,
                  ``byte_budget_max`` the memory cap; 503/429 throttling still wins. Only
                  timing changes, never the data order. ``False`` keeps every knob as set (the
                  budget too). ``STREAMDATA_AUTOTUNE=0`` turns it off.
    tune_from:    where tuning starts ``window`` and ``max_requests`` (a dict, e.g.
                  ``{"window": 1, "max_requests": 1}``), below their bounds; ``None``: at them
                  (no slow start: benchmarks/README.md, "Latency"). The budget starts at
                  ``byte_budget``.
    max_requests_per_s: the whole job's requests per second to the store, split evenly over
                  its reading processes (RATE-SHARE, ``store.rate``): every request, retries
                  and size probes included, waits for its process's next slot. ``None``: the
                  store's own default, 10 for the Hugging Face Hub (``hf://``, which limits
                  the requests of an account), no limit for the others; ``math.inf``: no limit.
    """

    window: int = 32
    part_size: int = 8 * MiB
    first_part: int = 256 * 1024
    max_requests: int = 32
    byte_budget: int = 64 * MiB
    byte_budget_max: int | None = None
    retry_deadline: float = 300.0
    retries: int | None = None
    backoff: float = 0.1
    backoff_cap: float = 10.0
    timeout: float = 60.0
    cache_dir: str | None = None
    cache_limit: int | None = None
    presign_lifetime: int = 900
    autotune: bool = True
    tune_from: Any = None  # a dict in, held as sorted (name, value) pairs: the config stays hashable
    max_requests_per_s: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.autotune, int) and not isinstance(self.autotune, bool) and self.autotune in (0, 1):
            object.__setattr__(self, "autotune", bool(self.autotune))  # STREAMDATA_AUTOTUNE=0/1
        if not isinstance(self.autotune, bool):
            raise SpecError(f"FetchConfig.autotune must be True or False, got {self.autotune!r}")
        if self.tune_from is not None:
            start = dict(self.tune_from)
            bad = sorted(k for k, v in start.items() if k not in _TUNE_FROM or isinstance(v, bool)
                         or not isinstance(v, int) or v < 1)
            if bad:
                raise SpecError(f"FetchConfig.tune_from takes {' and '.join(_TUNE_FROM)} as whole numbers "
                                f">= 1; got {bad[0]}={start[bad[0]]!r}")
            object.__setattr__(self, "tune_from", tuple(sorted(start.items())))
        life: Any = self.presign_lifetime
        if isinstance(life, float) and life.is_integer():
            life = int(life)
            object.__setattr__(self, "presign_lifetime", life)
        if isinstance(life, bool) or not isinstance(life, int) or not 1 <= life <= PRESIGN_LIFETIME_MAX:
            raise SpecError(f"FetchConfig.presign_lifetime (STREAMDATA_PRESIGN_LIFETIME) must be whole "
                            f"seconds from 1 to {PRESIGN_LIFETIME_MAX} (7 days, S3's longest), got {life!r}")
        rate = self.max_requests_per_s
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))
                                 or not rate > 0):
            raise SpecError(f"FetchConfig.max_requests_per_s must be requests per second > 0 (math.inf: "
                            f"no limit) or None (the store's default), got {rate!r}")
        if self.cache_dir is not None:
            if not isinstance(self.cache_dir, (str, os.PathLike)):
                raise SpecError(f"FetchConfig.cache_dir must be a path or None, got {self.cache_dir!r}")
            path = os.fspath(self.cache_dir)
            object.__setattr__(self, "cache_dir", os.path.abspath(os.path.expanduser(path)) if path else None)
        limit = self.cache_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise SpecError(f"FetchConfig.cache_limit must be a number of bytes >= 1 or None, got {limit!r}")
        for name in ("window", "part_size", "first_part", "max_requests", "byte_budget"):
            if getattr(self, name) < 1:
                raise SpecError(f"FetchConfig.{name} must be >= 1, got {getattr(self, name)}")
        most = self.byte_budget_max
        if most is not None and (isinstance(most, bool) or not isinstance(most, int)
                                 or most < self.byte_budget):
            raise SpecError(f"FetchConfig.byte_budget_max must be a number of bytes >= byte_budget "
                            f"({self.byte_budget}) or None, got {most!r}")
        if (self.retries is not None and self.retries < 0) or self.backoff < 0 or self.timeout <= 0 \
                or self.retry_deadline < 0 or self.backoff_cap < 0:
            raise SpecError("FetchConfig: retries, retry_deadline, backoff and backoff_cap must be >= 0 "
                            "and timeout > 0")

    def wait_limit(self) -> float:
        """Seconds a reader waits for one part before it raises ``FetchTimeoutError``: past
        the moment the part's own retries must have ended (its last attempt starts before
        ``retry_deadline`` and lasts at most ``timeout``; one more ``timeout`` for a slot under
        READER-THROTTLE), plus slack. So a wait never hangs, and never fails before the
        part's deadline."""
        return self.retry_deadline + 2 * self.timeout + 30.0

    def budget_max(self) -> int:
        """The most the byte budget grows to (BUDGET-GROWTH)."""
        return 2 * self.byte_budget if self.byte_budget_max is None else self.byte_budget_max

    def replace(self, **changes) -> FetchConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def resolve(cls, config: FetchConfig | None = None, owner: object = None, /, *,
                defaults: Mapping[str, Any] | None = None, **overrides: Any) -> FetchConfig:
        """The one place a dataset's flat keyword options become its ``FetchConfig``.

        ``config`` (else :meth:`from_env`) is the base; ``overrides`` (``None`` = not given)
        replace its fields; ``defaults`` are a dataset's own defaults (Parquet's window), used
        only for fields that no ``config``, environment variable or override chose. An unknown
        option is a ``SpecError`` that names the nearest known one, the fetch options' and
        ``owner``'s own keyword parameters (its class's ``__init__``s) alike.
        """
        groups = {name: overrides.pop(name) for name in list(overrides) if name in _GROUPS}
        given = sorted(k for k, v in overrides.items() if v is not None and k in _GROUP_OF)
        if given and owner is not None:  # the flat keywords of a dataset or writer
            import warnings

            hint = ", ".join(f"{_GROUP_OF[k][0]}=sd.{_GROUPS[_GROUP_OF[k][0]][0].__name__}"
                             f"({_GROUP_OF[k][1]}=...)" for k in given)
            warnings.warn(f"{type(owner).__name__}: flat fetch options ({', '.join(given)}) are deprecated "
                          f"and will be removed: give them as option groups, {hint}", DeprecationWarning,
                          stacklevel=_caller_level())
        for name, group in groups.items():
            klass, fields = _GROUPS[name]
            if group is None:
                continue
            if not isinstance(group, klass):
                raise SpecError(f"{name}= takes sd.{klass.__name__}(...), got {type(group).__name__}")
            for field, flat in fields.items():
                value = getattr(group, field)
                if value is None:
                    continue
                if overrides.get(flat) is not None:
                    raise SpecError(f"{flat} is given twice: as {flat}= and as {name}=sd.{klass.__name__}"
                                    f"({field}=...): give it once")
                overrides[flat] = value
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            known = names | set(_GROUPS) | _own_options(owner)
            near = difflib.get_close_matches(unknown[0], sorted(known), n=1, cutoff=0.7)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise SpecError(f"unknown option {unknown[0]!r}{hint}; "
                            f"fetch options are {', '.join(sorted(names))}, or the groups "
                            "fetch=sd.Fetch(...), retry=sd.Retry(...), cache=sd.Cache(...)")
        base = config or cls.from_env()
        chosen = {k: v for k, v in overrides.items() if v is not None}
        if config is None:
            chosen = {**{k: v for k, v in (defaults or {}).items()
                         if env_str(_ENV.get(k, "")) is None}, **chosen}
        return base.replace(**chosen)

    @classmethod
    def from_env(cls) -> FetchConfig:
        """Defaults, overridden by STREAMDATA_WINDOW / _PART_SIZE / _MAX_REQUESTS / _BYTE_BUDGET /
        _BYTE_BUDGET_MAX, STREAMDATA_CACHE_DIR / _CACHE_LIMIT, STREAMDATA_PRESIGN_LIFETIME and
        STREAMDATA_AUTOTUNE."""
        base = cls()
        return base.replace(**{field: (env_str if field in _ENV_STR else env_int)(name, getattr(base, field))
                               for field, name in _ENV.items()})


_ENV = {"window": "STREAMDATA_WINDOW", "part_size": "STREAMDATA_PART_SIZE",
        "max_requests": "STREAMDATA_MAX_REQUESTS", "byte_budget": "STREAMDATA_BYTE_BUDGET",
        "byte_budget_max": "STREAMDATA_BYTE_BUDGET_MAX",
        "cache_dir": "STREAMDATA_CACHE_DIR", "cache_limit": "STREAMDATA_CACHE_LIMIT",
        "presign_lifetime": "STREAMDATA_PRESIGN_LIFETIME", "autotune": "STREAMDATA_AUTOTUNE"}
_TUNE_FROM = ("window", "max_requests")  # the knobs ``tune_from`` may start below their bound
_ENV_STR = {"cache_dir"}  # read as text; the others as integers


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside streamdata (a warning points at the user's line)."""
    import sys

    frame: Any = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("streamdata"):
        frame, level = frame.f_back, level + 1
    return level


def _own_options(owner: object) -> set[str]:
    """The keyword parameters of ``owner``'s class's ``__init__``s (an unknown option's hint)."""
    if owner is None:
        return set()
    found: set[str] = set()
    for klass in type(owner).__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        try:
            params = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            continue
        found |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return found - {"self"}
