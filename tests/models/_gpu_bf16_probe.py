import jax.numpy as jnp, numpy as np, tempfile, pathlib
import models.qwen2 as q
import sys, pallas_kernels; pa, kw = sys.modules["pallas_kernels.paged_attention"], sys.modules["pallas_kernels.kv_write"]
from models import *
from tests.models.numpy_reference import *
from flax import nnx
def run(d, dt, toks):
    m = load_pretrained(d, dtype=dt)
    meta = build_metadata([0],[6],[[0,1]], page_size=4, num_tokens=12, num_reqs=4, max_pages=4)
    lg,_ = forward_apply(*nnx.split(m), pack_tokens([toks], 12), init_kv_pages(m.config, 12, 4, dt), meta)
    return np.asarray(lg)[:6]
for tied in (True, False):
  cfg = small_hf_config(tied=tied); w = random_hf_weights(cfg, 1 if tied else 2)
  d = write_hf_checkpoint(pathlib.Path(tempfile.mkdtemp()), cfg, w)
  toks = np.random.default_rng(9).integers(0, 97, 6).tolist()
  ref = reference_logits(w, cfg, toks)
  for dt in (jnp.float32, jnp.bfloat16):
    for name, attn, wr in (("kernels", pa.paged_attention, kw.write_kv), ("jnp-ref", pa.paged_attention_reference, kw.write_kv_reference)):
      q.paged_attention, q.write_kv = attn, wr
      forward_apply.clear_cache() if hasattr(forward_apply, "clear_cache") else None
      lg = run(d, dt, toks)
      print(tied, jnp.dtype(dt).name, name, 'maxerr/max', np.abs(lg-ref).max()/np.abs(ref).max())
