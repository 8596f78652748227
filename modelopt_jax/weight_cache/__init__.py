"""Weight-cache daemon (host mode): load and process a checkpoint once, let other processes attach.

A per-device daemon (:mod:`.daemon`) runs the ordinary loader once, records what the model
builder received (:mod:`.layout`), copies every processed array into one POSIX shared-memory
segment (:mod:`.host_store`) and then serves a Unix socket speaking length-prefixed JSON
(:mod:`.protocol`). A client (:mod:`.client`) sends the fingerprint of what it would process
(:mod:`.fingerprint`); on a match it maps the segment and rebuilds the same modules around views
of it -- no checkpoint tensor read, no transpose/requantize/pad. CUDA IPC mode is not implemented.
"""

from modelopt_jax.weight_cache.paths import default_socket_dir, lock_path, socket_path  # noqa: F401

MODES = ("off", "auto", "require")
