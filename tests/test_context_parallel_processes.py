"""Context parallelism across two JAX processes (`jax.distributed`, 4 CPU devices each, gloo
collectives): the ring, all_to_all and halo strategies over a mesh axis that spans both processes
(all_to_all with packed documents balanced per document too), forward and gradients equal to one
device's on each process's shards.

The test starts this file twice as a worker (`python this_file WORKER_ID PORT`)."""
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROCESSES, LOCAL_DEVICES = 2, 4
B, T, N, H = 2, 64, 8, 8
# packed documents of 3-20 tokens, cut per document over the devices (load_balanced="documents")
DOCUMENTS = [[d for d, size in enumerate([5, 20, 3, 9, 17, 10], 1) for _ in range(size)],
             [d for d, size in enumerate([12, 4, 19, 8, 6, 15], 1) for _ in range(size)]]
CASES = [  # (strategy, load_balanced, attention kwargs)
    ("ring", True, dict(is_causal=True)),
    ("all_to_all", False, dict(is_causal=True)),
    ("halo", False, dict(is_causal=True, local_window_size=(11, 0))),
    ("halo", True, dict(local_window_size=(5, 9))),
    ("halo", False, dict(is_causal=True, chunk_size=16)),
    ("all_to_all", "documents", dict(is_causal=True, segment_ids=DOCUMENTS)),
]


def test_two_processes_with_four_cpu_devices_each():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               XLA_FLAGS=f"--xla_force_host_platform_device_count={LOCAL_DEVICES}")
    workers = [subprocess.Popen([sys.executable, __file__, str(i), str(port)], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for i in range(PROCESSES)]
    outputs = [w.communicate(timeout=900)[0] for w in workers]
    for i, (w, out) in enumerate(zip(workers, outputs)):
        assert w.returncode == 0 and f"worker {i}: {len(CASES)} cases equal" in out, out[-6000:]


def worker(process_id: int, port: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import sdpagraph

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=PROCESSES, process_id=process_id)
    cp = jax.device_count()
    assert cp == PROCESSES * LOCAL_DEVICES and jax.local_device_count() == LOCAL_DEVICES
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices())
    sharding = NamedSharding(mesh, P(None, "cp"))
    rng = np.random.default_rng(0)  # the same arrays in both processes
    for strategy, load_balanced, kwargs in CASES:
        if "segment_ids" in kwargs:
            kwargs = dict(kwargs, segment_ids=np.asarray(kwargs["segment_ids"], np.int32))
        q, k, v, cot = (rng.standard_normal((B, T, N, H)).astype(np.float32) for _ in range(4))

        def loss(q, k, v, cot, **cp_kwargs):
            return jnp.sum(sdpagraph.attention(q, k, v, **kwargs, **cp_kwargs) * cot)

        ref_grads = jax.grad(lambda q, k, v: loss(q, k, v, cot, implementation="xla"), argnums=(0, 1, 2))(q, k, v)
        ref_out = sdpagraph.attention(q, k, v, implementation="xla", **kwargs)
        order = (lambda x: np.asarray(sdpagraph.load_balance(x, cp))) if load_balanced else (lambda x: x)  # noqa: E731
        if load_balanced == "documents":  # the ids stay in their natural order
            order = lambda x: np.asarray(sdpagraph.load_balance(x, cp, segment_ids=kwargs["segment_ids"]))  # noqa: E731
        place = lambda x: jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])  # noqa: E731
        args = [place(order(x)) for x in (q, k, v, cot)]
        cp_kwargs = dict(context_parallel_axis="cp", context_parallel_strategy=strategy, load_balanced=load_balanced)
        with jax.set_mesh(mesh):
            out = jax.jit(lambda q, k, v: sdpagraph.attention(q, k, v, **kwargs, **cp_kwargs))(*args[:3])
            grads = jax.jit(jax.grad(lambda q, k, v, cot: loss(q, k, v, cot, **cp_kwargs), argnums=(0, 1, 2)))(*args)
        for ours, ref in zip((out, *grads), (ref_out, *ref_grads)):
            ref = order(np.asarray(ref))
            for shard in ours.addressable_shards:
                np.testing.assert_allclose(np.asarray(shard.data), ref[shard.index], rtol=3e-5, atol=3e-5,
                                           err_msg=f"{strategy}, load_balanced={load_balanced}, {kwargs}")
    print(f"worker {process_id}: {len(CASES)} cases equal", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]))
