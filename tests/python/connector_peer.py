"""A decode worker for the connector test, in its own process: listens with a consumer
KVConnector, loads the requests it is told into zeroed caches layer by layer, saves each cache
as REQUEST.npy and exits when its standard input closes (the producer is done: closing earlier
would break the producer's last END message). Prints its port first."""

import argparse
import sys

import numpy as np

import kvserve

ap = argparse.ArgumentParser()
ap.add_argument("--shape", required=True, help="n_layer,n_head_kv,n_token,head_dim")
ap.add_argument("--requests", required=True, help="comma-separated request ids")
ap.add_argument("--out", required=True)
args = ap.parse_args()
n_layer, n_head_kv, n_token, head_dim = (int(x) for x in args.shape.split(","))
with kvserve.KVConnector("consumer", n_layer=n_layer, listen="127.0.0.1:0", timeout_s=60) as conn:
    print(f"PORT {conn.port}", flush=True)
    for rid in (int(x) for x in args.requests.split(",")):
        cache = np.zeros((n_layer, 2, n_head_kv, n_token, head_dim), dtype=np.float16)
        conn.start_load_kv(rid, cache)
        for layer in range(n_layer):
            conn.wait_for_layer_load(rid, layer)
        np.save(f"{args.out}/{rid}.npy", cache)
        conn.request_finished(rid)
    sys.stdin.read()  # until the test closes it: the producer has sent everything
print("DONE", flush=True)
sys.exit(0)
