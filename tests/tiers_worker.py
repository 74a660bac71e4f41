"""A worker process of the tier tests: for each phase, a new Engine per format over the tiny model with
that phase's tiers, generating a set of prompts; prints each phase's tokens and counters as JSON. Usage:
python tiers_worker.py '{"phases": [{"remote": url}, {"disk": dir}], "formats": [null, "int8"], "seed": 3, "n": 2}'"""

import json
import sys

import kvcache
from tiers_support import CHUNK, PAGE, prompts, tiny_model

args = json.loads(sys.argv[1])
model = tiny_model()
phases = []
for tiers in args["phases"]:
    out = {}
    for fmt in args["formats"]:
        engine = kvcache.Engine(model, kv_format=fmt, page_size=PAGE, chunk_tokens=CHUNK, **tiers)
        results = engine.generate(prompts(args["seed"], args["n"]), max_new_tokens=4)
        engine.close()
        s = engine.stats()
        out[str(fmt)] = {"tokens": [r.tokens for r in results], "prefill_tokens": s["prefill_tokens"],
                         "prompt_tokens": s["prompt_tokens"],
                         **{k: s["tiers"][k] for k in ("remote_hit_tokens", "disk_hit_tokens", "bad_blobs")}}
    phases.append(out)
print(json.dumps(phases))
