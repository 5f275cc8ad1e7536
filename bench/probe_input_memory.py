"""How much device memory a (1, T, N, H) bf16 array split over 2 GPUs along T holds, made four ways:
on device 0 then device_put, from host NumPy, from a callback per shard, and drawn on the devices
by a jitted random draw with out_shardings. Prints memory_stats()["bytes_in_use"] per device.

    python bench/probe_input_memory.py [T]
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

T = int(sys.argv[1]) if len(sys.argv) > 1 else 131072
SHAPE = (1, T, 16, 128)
devices = jax.devices()[:2]
placement = NamedSharding(Mesh(np.array(devices), ("cp",)), P(None, "cp"))
rng = np.random.default_rng(0)


def in_use():
    return " / ".join(f"{d.memory_stats()['bytes_in_use'] / 2**30:.3f}" for d in devices)


WAYS = {
    "jnp.asarray on device 0, then device_put": lambda: jax.device_put(
        jnp.asarray(rng.standard_normal(SHAPE), jnp.bfloat16), placement),
    "host NumPy bf16, device_put": lambda: jax.device_put(rng.standard_normal(SHAPE).astype(jnp.bfloat16), placement),
    "make_array_from_callback": lambda: jax.make_array_from_callback(
        SHAPE, placement, lambda index: rng.standard_normal(SHAPE)[index].astype(jnp.bfloat16)),
    "jitted jax.random with out_shardings": lambda: jax.jit(
        lambda key: jax.random.normal(key, SHAPE, jnp.bfloat16), out_shardings=placement)(jax.random.key(0)),
}
print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, shape {SHAPE} bf16 "
      f"({np.prod(SHAPE) * 2 / 2**30:.3f} GiB whole, half a device): GiB in use on devices 0 / 1")
print(f"start: {in_use()}")
for name, make in WAYS.items():
    x = jax.block_until_ready(make())
    print(f"{name}: {in_use()} (shards {[s.data.shape for s in x.addressable_shards]})", flush=True)
    del x
    print(f"  after del: {in_use()}", flush=True)
