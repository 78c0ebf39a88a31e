"""A cache folder for what the fast path compiles and tunes, so a second start skips it.

``qwen-trt serve`` on a GPU spends most of its start compiling Triton kernels and timing the
batched GEMM's autotune configurations. This keeps both on disk, in a folder keyed by what the
results depend on (:class:`CacheKey`: the GPU, its driver, torch, Triton, the dtype, the model's
shapes, the weight format, the batch buckets and a hash of our kernel sources)::

    <root>/<digest>/key.json       the key, written last (a folder without it is rebuilt)
    <root>/<digest>/triton/        TRITON_CACHE_DIR: compiled kernels (and Triton's own
                                   autotune results where it keeps them)
    <root>/<digest>/inductor/      TORCHINDUCTOR_CACHE_DIR: torch.compile's graphs and kernels
    <root>/<digest>/autotune.json  our tuners' choices: {tuner: {repr(key): config index}},
                                   and under "_picks" the warm-up's own timed choices:
                                   {name: {key: value}} (:meth:`CompileCache.pick`)
    <root>/<digest>/checks.json    the kernel self-checks that passed, and the weights they
                                   passed on: {"weights": id, "passed": [name, ...]}

A new folder starts from a **seed** when one ships for it (``qwen_trt/fast/seeds/*.json``: a
warm folder's autotune.json measured on a GPU, :func:`make_seed`), matched on the GPU, its
capability, Triton's minor version, the dtype, the model's shapes, the weight format and the
buckets, and per tuner on its configuration list: the tuners then compile and time only the
seeded configuration, and the warm-up's timings their seeded pick (a fresh machine's start).
The self-checks still run: a seed only saves timing.

``root`` is ``--cache-dir`` / ``$QWEN_TRT_CACHE_DIR``, default ``~/.cache/qwen-trt``. A folder
whose ``key.json`` does not match, or a choices file that does not parse, is reported in one
line and rebuilt; a choice that names no known configuration is ignored (tuned again). The
engine process's restart after a crash opens the same folder, so it starts warm too.

The warm-up's timings that are not Triton autotuners (the batched model's projection kernel per
batch bucket, its varlen attention tile per token bucket) go through :func:`active`: the cache
the current load opened, whose :meth:`~CompileCache.pick` gives the choice a previous start
timed (when it is still one of the caller's options) and :meth:`~CompileCache.remember`
keeps a new one for the next start.

The Triton self-checks (the kernels against PyTorch on this GPU: :func:`run_check`) are
skipped on a warm start when this folder recorded them passing for the same weights (the key
already pins the GPU, driver, torch, Triton, dtype, shapes and kernel sources, which is what
their outcome depends on); each skip is said in one line. A cold or stale folder, a check that
failed before, other weights, or ``QWEN_TRT_SELF_CHECKS=always`` runs them.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from qwen_trt import settings

ENV_CACHE_DIR = "QWEN_TRT_CACHE_DIR"
DEFAULT_ROOT = Path(settings.declared(ENV_CACHE_DIR).default)     # ~/.cache/qwen-trt
PICKS = "_picks"            # autotune.json's section of named choices (never a tuner's name)
SEEDS_DIR = Path(__file__).resolve().parent / "seeds"   # shipped choices (data, see make_seed)
# every module whose kernels the cache compiles or whose self-checks a warm start skips (a change
# to any of them must give a new key: the checks' passes are only valid for the same sources)
KERNEL_SOURCES = ("kernels/attention.py", "kernels/bgemm.py", "kernels/gemv.py",
                  "kernels/kernel_parts.py", "kernels/linear.py", "kernels/paged_kernels.py",
                  "kernels/pdl.py", "kernels/qkernel_parts.py", "kernels/qkernels.py",
                  "kernels/qkernels_fp8.py", "kernels/qkernels_gemm.py",
                  "kernels/qkernels_int4.py", "kernels/rope_cache.py",
                  "model/kv_cache.py", "model/model.py", "model/qformats.py",
                  "step/batched.py", "step/decoder.py", "step/graphs.py")


def cache_root(cache_dir: str | None = None, environ=None) -> Path:
    # absolute once, here: Triton joins TRITON_CACHE_DIR as given, and a relative folder would
    # be resolved against whatever the working directory is when a kernel first compiles
    return Path(cache_dir or settings.get(ENV_CACHE_DIR, environ)).expanduser().absolute()


def kernel_sources_hash() -> str:
    """A hash of the fast path's kernel and model sources (any edit there starts afresh)."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in KERNEL_SOURCES:
        p = here / name
        h.update(name.encode())
        h.update(p.read_bytes() if p.exists() else b"-")
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class CacheKey:
    gpu: str
    capability: str
    driver: str
    torch: str
    triton: str
    dtype: str
    shapes: str                 # the model config's shape fields, as JSON
    weight_format: str
    buckets: str                # batch / token buckets the runner captures
    kernels: str                # kernel_sources_hash()

    def digest(self) -> str:
        raw = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(raw.encode()).hexdigest()[:20]


def key_for(cfg, dtype, device, *, weight_format: str = "bf16-safetensors",
            buckets: str = "") -> CacheKey:
    """The key for the fast path on ``device`` with model config ``cfg`` (a FastConfig)."""
    import torch

    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = "none"
    dev = torch.device(device)
    if dev.type == "cuda":
        gpu = torch.cuda.get_device_name(dev)
        cap = ".".join(map(str, torch.cuda.get_device_capability(dev)))
        driver = _driver_version()
    else:
        gpu, cap, driver = "cpu", "", ""
    shapes = json.dumps(asdict(cfg) if hasattr(cfg, "__dataclass_fields__") else vars(cfg),
                        sort_keys=True, default=str)
    return CacheKey(gpu=gpu, capability=cap, driver=driver, torch=torch.__version__,
                    triton=triton_v, dtype=str(dtype).replace("torch.", ""), shapes=shapes,
                    weight_format=weight_format, buckets=buckets, kernels=kernel_sources_hash())


def buckets_key(*, for_runner: bool, max_batch: int | None, max_seq_len: int) -> str:
    """The key's ``buckets`` for a fast-path load (what the captured graphs depend on)."""
    return f"runner={for_runner} max_batch={max_batch} max_seq_len={max_seq_len}"


def format_key(spec) -> str:
    """The key's ``weight_format`` for a :class:`qwen_trt.fast.model.qformats.QuantSpec` (the
    resolved format, whether the checkpoint holds it or the load quantizes to it)."""
    if spec.method == "none":
        return "bf16-safetensors"
    shape = f"block={'x'.join(map(str, spec.block))}" if spec.method == "fp8" \
        else f"group={spec.group}"
    return f"{spec.method}-{shape}"


def _driver_version() -> str:
    try:
        import torch

        return str(torch.cuda.driver_version()) if hasattr(torch.cuda, "driver_version") \
            else str(torch._C._cuda_getDriverVersion())
    except Exception:  # noqa: BLE001 - the key then simply lacks it
        return ""


class CompileCache:
    """One keyed folder (module docstring). ``say`` gets the one-line notes."""

    def __init__(self, root: Path, key: CacheKey, say=print) -> None:
        self.root = Path(root)
        self.key = key
        self.folder = self.root / key.digest()
        self._say = say
        self.warm = False          # the folder was complete when opened
        self.loaded_choices = 0
        self.picks: dict[str, dict[str, object]] = {}   # name -> {key: value}
        self.picked = 0            # choices served by pick() (timings skipped)
        self.weights_id = ""       # the loaded weights (:func:`weights_id`; "": unknown)
        self.passed: set[str] = set()        # self-checks recorded passing (on weights_id)
        self.skipped: list[str] = []         # self-checks this start skipped
        self.seeded = ""                     # the seed file a new folder's choices came from

    def open(self, *, set_env: bool = True) -> "CompileCache":
        """Make the folder usable (rebuilding a stale or broken one; each part checked writable
        by a probe file) and point Triton and inductor at it (unless the user set their own
        folders and those are writable too: one that is not is replaced, in one line)."""
        key_file = self.folder / "key.json"
        if self.folder.exists():
            problem = None
            try:
                got = json.loads(key_file.read_text())
                if got != asdict(self.key):
                    problem = "its key does not match"
            except FileNotFoundError:
                problem = "it was not finished"
            except (OSError, ValueError) as e:
                problem = f"its key is unreadable ({type(e).__name__})"
            if problem:
                self._say(f"compile cache {self.folder}: {problem}; rebuilding it")
                shutil.rmtree(self.folder, ignore_errors=True)
            else:
                self.warm = True
                self._load_checks()
        for sub in ("triton", "inductor"):
            problem = writable_problem(self.folder / sub)
            if problem:             # OSError: open_for_fast_path starts without the cache
                raise PermissionError(f"{self.folder / sub} is not writable ({problem})")
        if set_env:
            for var, sub in (("TRITON_CACHE_DIR", "triton"), ("TORCHINDUCTOR_CACHE_DIR",
                                                              "inductor")):
                ours = str(self.folder / sub)
                theirs = os.environ.get(var, "").strip()
                if theirs and theirs != ours:          # the user's own folder: kept if usable
                    problem = writable_problem(Path(theirs))
                    if problem is None:
                        continue
                    self._say(f"{var}={theirs} is not writable ({problem}); using {ours}")
                os.environ[var] = ours
        return self

    def seal(self) -> None:
        """Write checks.json, then key.json: the folder is complete (after the warm-up)."""
        if self.weights_id:
            _write_atomic(self.folder / "checks.json", json.dumps(
                {"weights": self.weights_id, "passed": sorted(self.passed)}, indent=1))
        _write_atomic(self.folder / "key.json", json.dumps(asdict(self.key), indent=1))

    # -- the kernel self-checks ----------------------------------------------------------------
    def _load_checks(self) -> None:
        """The checks recorded passing, if on the weights now loaded (else none)."""
        try:
            data = json.loads((self.folder / "checks.json").read_text())
            passed = data["passed"] if data.get("weights") == self.weights_id else []
            self.passed = {str(n) for n in passed} if self.weights_id else set()
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            self.passed = set()        # none recorded, or unreadable: run them

    def known_good(self, name: str) -> bool:
        """Whether self-check ``name`` passed on an earlier start with this key and weights."""
        return self.warm and bool(self.weights_id) and name in self.passed

    def record_check(self, name: str, problem: str | None) -> None:
        if problem is None:
            self.passed.add(name)
        else:
            self.passed.discard(name)

    # -- our autotuners' choices ---------------------------------------------------------------
    def load_choices(self, tuners: dict, seeds_dir: Path | None = None) -> int:
        """Fill each tuner's ``cache`` (a triton Autotuner's: key tuple -> Config) from
        autotune.json, or, in a folder without one, from a matching seed (module docstring;
        :attr:`seeded` names it); returns how many choices were restored."""
        path = self.folder / "autotune.json"
        self.seeded = ""
        if not path.exists():
            found = find_seed(self.key, seeds_dir)
            if found is None:
                return 0
            seed_path, seed = found
            same = {name for name, t in tuners.items()
                    if seed.get("fingerprints", {}).get(name) == tuner_fingerprint(t)}
            data = {k: v for k, v in seed["choices"].items() if k == PICKS or k in same}
            n = self._apply_choices(data, tuners)
            self.seeded = seed_path.name if n else ""
            return n
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                raise ValueError("not an object")
        except (OSError, ValueError) as e:
            self._say(f"compile cache {path}: unreadable ({type(e).__name__}); tuning again")
            path.unlink(missing_ok=True)
            return 0
        return self._apply_choices(data, tuners)

    def _apply_choices(self, data: dict, tuners: dict) -> int:
        n = 0
        picks = data.get(PICKS)
        if isinstance(picks, dict):
            self.picks = {str(k): dict(v) for k, v in picks.items() if isinstance(v, dict)}
            n += sum(len(v) for v in self.picks.values())
        for name, tuner in tuners.items():
            configs = list(getattr(tuner, "configs", ()))
            rows = data.get(name)
            for raw_key, index in (rows if isinstance(rows, dict) else {}).items():
                try:
                    key = ast.literal_eval(raw_key)
                except (ValueError, SyntaxError):
                    continue
                if isinstance(index, int) and 0 <= index < len(configs):
                    tuner.cache[key] = configs[index]
                    n += 1
        self.loaded_choices = n
        return n

    def save_choices(self, tuners: dict) -> int:
        """Write each tuner's current choices to autotune.json; returns how many."""
        data: dict = {}
        n = 0
        for name, tuner in tuners.items():
            configs = list(getattr(tuner, "configs", ()))
            rows = {}
            for key, cfg in dict(getattr(tuner, "cache", {})).items():
                idx = next((i for i, c in enumerate(configs) if c is cfg or _same(c, cfg)), None)
                if idx is not None:
                    rows[repr(key)] = idx
            data[name] = rows
            n += len(rows)
        if self.picks:
            data[PICKS] = self.picks
            n += sum(len(v) for v in self.picks.values())
        _write_atomic(self.folder / "autotune.json", json.dumps(data, indent=1, sort_keys=True))
        return n


    # -- the warm-up's own timed choices -------------------------------------------------------
    def pick(self, name: str, key, allowed):
        """The value a previous start timed for ``(name, key)`` if it is one of ``allowed``
        (a list from JSON matches a tuple); None: time it."""
        value = self.picks.get(name, {}).get(str(key))
        if isinstance(value, list):
            value = tuple(value)
        if value is None or value not in allowed:
            return None
        self.picked += 1
        return value

    def remember(self, name: str, key, value) -> None:
        """Keep ``value`` (JSON: a string, a number, a list) for the next start."""
        self.picks.setdefault(name, {})[str(key)] = value


def seed_match(key: CacheKey) -> dict:
    """What a seed must share with a cache key: the GPU and its capability, Triton's minor
    version, the dtype, the model's shapes (a digest), the weight format and the buckets (not
    the driver, torch or our sources: the choices stay valid configurations across those, and
    a seeded start still tunes what the seed lacks)."""
    return {"gpu": key.gpu, "capability": key.capability,
            "triton": ".".join(key.triton.split(".")[:2]), "dtype": key.dtype,
            "shapes": hashlib.sha256(key.shapes.encode()).hexdigest()[:16],
            "weight_format": key.weight_format, "buckets": key.buckets}


def tuner_fingerprint(tuner) -> str:
    """A tuner's configuration list (a seed's indices are only valid for the same list)."""
    parts = [repr((sorted(getattr(c, "kwargs", {}).items()), getattr(c, "num_warps", None),
                   getattr(c, "num_stages", None))) for c in getattr(tuner, "configs", ())]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def make_seed(folder: Path, tuners: dict, source: str) -> dict:
    """A seed (module docstring) from a complete cache folder: its key's match fields, the
    tuners' fingerprints, its autotune.json, and ``source`` (where and when it was measured)."""
    folder = Path(folder)
    key = CacheKey(**json.loads((folder / "key.json").read_text()))
    choices = json.loads((folder / "autotune.json").read_text())
    return {"source": source, "match": seed_match(key),
            "fingerprints": {name: tuner_fingerprint(t) for name, t in tuners.items()},
            "choices": choices}


def find_seed(key: CacheKey, seeds_dir: Path | None = None) -> tuple[Path, dict] | None:
    """The first shipped seed (sorted by file name) whose match fields are ``key``'s; an
    unreadable seed file is skipped."""
    want = seed_match(key)
    folder = SEEDS_DIR if seeds_dir is None else Path(seeds_dir)
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        try:
            seed = json.loads(path.read_text())
            if seed.get("match") == want and isinstance(seed.get("choices"), dict):
                return path, seed
        except (OSError, ValueError, AttributeError):
            continue
    return None


_ACTIVE: CompileCache | None = None


def active() -> CompileCache | None:
    """The cache the current fast-path load opened (None: no cache, e.g. on CPU)."""
    return _ACTIVE


def weights_id(folder) -> str:
    """The checkpoint's weight files by name, size and modification time ("" without any): a
    self-check's record holds only for the weights it ran on."""
    try:
        files = sorted(Path(folder).glob("*.safetensors"))
        parts = [f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}" for f in files
                 for st in [f.stat()]]
    except (OSError, TypeError):
        return ""
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20] if parts else ""


def self_checks_forced() -> bool:
    """``QWEN_TRT_SELF_CHECKS=always`` (read once, with the other kernel options)."""
    from qwen_trt.fast.options import options

    return options().self_checks == "always"


def run_check(name: str, check: Callable[[], str | None]) -> str | None:
    """``check()`` (None: passed, else a one-line problem), unless the active cache recorded
    ``name`` passing on an earlier start with this key and these weights and the checks are
    not forced: then None without running it (the skip is said by :func:`close_after_warmup`
    and :func:`skipped_checks`). Every check that runs is recorded for the next start."""
    if may_skip(name):
        return None
    problem = check()
    record_check(name, problem)
    return problem


def may_skip(name: str) -> bool:
    """Whether self-check ``name`` may be skipped now (see :func:`run_check`); a skip is
    counted in :func:`skipped_checks`."""
    cache = active()
    if cache is None or not cache.known_good(name) or self_checks_forced():
        return False
    if name not in cache.skipped:
        cache.skipped.append(name)
    return True


def record_check(name: str, problem: str | None) -> None:
    """Keep a check's outcome (None: passed) in the active cache, for the next start."""
    cache = active()
    if cache is not None:
        cache.record_check(name, problem)


def skipped_checks() -> list[str]:
    """The self-checks the active cache let this start skip."""
    cache = active()
    return list(cache.skipped) if cache is not None else []


def _same(a, b) -> bool:
    return (getattr(a, "kwargs", None) == getattr(b, "kwargs", None)
            and getattr(a, "num_warps", None) == getattr(b, "num_warps", None)
            and getattr(a, "num_stages", None) == getattr(b, "num_stages", None))


def writable_problem(folder: Path) -> str | None:
    """None when this process can create ``folder`` (and its parents) and write a file in it,
    else the reason in one line. Triton and inductor write there as the first kernel
    compiles; a folder they cannot write turns every kernel self-check into a fallback."""
    try:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        mode = folder.stat().st_mode
        if mode & 0o700 != 0o700:        # a restrictive umask or mode: we own what we made
            try:
                folder.chmod(mode | 0o700)
            except OSError:
                pass
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
    return None


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        fh.write(text + "\n")
    os.replace(tmp, path)


def tuners() -> dict:
    """Our Triton autotuners by name (empty without Triton)."""
    try:
        from qwen_trt.fast.kernels import bgemm
    except ImportError:
        return {}
    t = getattr(bgemm, "_bgemm_tuned", None)
    return {"bgemm": t} if t is not None and hasattr(t, "cache") else {}


def open_for_fast_path(cfg, dtype, device, *, cache_dir: str | None, buckets: str,
                       say=print, weights=None,
                       weight_format: str = "bf16-safetensors") -> CompileCache | None:
    """The cache for a fast-path load on ``device`` (None on CPU: nothing is compiled there,
    or when ``cache_dir`` is "off"); opened, env set, our tuners' choices restored.
    ``weights``: the checkpoint folder (the self-checks' records are kept per weights);
    ``weight_format``: how the projections are held (:func:`format_key`), so a
    ``--quantization fp8`` start never takes a bf16 start's self-check passes or choices."""
    import torch

    global _ACTIVE
    _ACTIVE = None                 # an earlier load's cache is not this one's
    cache_dir = cache_dir or settings.get(ENV_CACHE_DIR)     # the flag, else the variable
    if torch.device(device).type != "cuda" or cache_dir.strip().lower() == "off":
        return None
    root = cache_root(cache_dir)
    try:
        cache = CompileCache(root, key_for(cfg, dtype, device, buckets=buckets,
                                            weight_format=weight_format), say)
        cache.weights_id = weights_id(weights) if weights is not None else ""
        cache.open()
    except OSError as e:
        say(f"compile cache under {root} is not usable ({e}); starting without it")
        return None
    n = cache.load_choices(tuners())
    _ACTIVE = cache
    seeded = f" seeded from {cache.seeded}" if cache.seeded else ""
    say(f"compile cache {cache.folder} ({'warm' if cache.warm else 'new'}"
        f"{f', {n} tuned choices{seeded}' if n else ''})")
    return cache


def close_after_warmup(cache: CompileCache | None, say=print) -> None:
    """Save the tuners' choices and seal the folder (after the warm-up captured the graphs)."""
    if cache is None:
        return
    if cache.picked:
        say(f"compile cache: {cache.picked} warm-up timings skipped (choices from the cache)")
    if cache.skipped:
        say(f"compile cache: self-checks skipped ({', '.join(cache.skipped)}): they passed on an "
            f"earlier start with this key and these weights (QWEN_TRT_SELF_CHECKS=always runs "
            f"them)")
    try:
        cache.save_choices(tuners())
        cache.seal()
    except OSError as e:
        say(f"compile cache {cache.folder}: could not be written ({e})")
