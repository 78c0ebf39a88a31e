"""Cold load + runner warm-up of the fast path in one process, phase by phase (device use:
``python3 scripts/device_load_diag.py MODEL``): prints one JSON line."""
import json, sys, time
t = time.perf_counter()
import torch  # noqa
from qwen_trt.backends import BackendConfig, load_backend
ti = time.perf_counter() - t
b = load_backend(BackendConfig(model=sys.argv[1]), for_runner=True)
tl = time.perf_counter() - t - ti
from qwen_trt.serving.scheduler import batch_runner_for
r = batch_runner_for(b)
tr = time.perf_counter() - t - ti - tl
st = r.model.stats
try:
    from qwen_trt.fast.kernels.bgemm import _bgemm_tuned
    best = {str(k[:3]): str(v) for k, v in _bgemm_tuned.cache.items()}
except ImportError:   # no Triton (CPU)
    best = {}
print(json.dumps({"import_s": round(ti, 1), "load_s": round(tl, 1), "runner_s": round(tr, 1),
                  "phases": st.phases_s, "bucket_ms": st.bucket_ms, "varlen_ms": st.varlen_ms,
                  "notes": st.notes,
                  "bgemm_best": best}))
