"""Weight-cache daemon: load and process a checkpoint once, let other processes attach.

A per-device daemon (:mod:`.daemon`) runs the load pipeline's stages once (plan, process, check
leftovers; :mod:`modelopt_jax.pipeline`), copies every processed array into one store and then
serves a Unix socket speaking length-prefixed JSON (:mod:`.protocol`). The store (:mod:`.placement`)
is one daemon-owned CUDA allocation exported over CUDA IPC on a GPU (:mod:`.cuda_store`, viewed
through :mod:`.dlpack_view`) and one POSIX shared-memory segment elsewhere (:mod:`.host_store`),
laid out by state path (:mod:`.layout`). A client (:mod:`.client`) sends the fingerprint of what it
would process (:mod:`.fingerprint`); on a match it receives the daemon's plan and index, maps the
store and builds the model around zero-copy views of it -- no checkpoint tensor read, no
transpose/requantize/pad. Under tensor parallelism each device's daemon serves that device's shard
and the loader stitches them like the shards of a disk load.
"""

from modelopt_jax.weight_cache.paths import default_socket_dir, lock_path, socket_path  # noqa: F401
