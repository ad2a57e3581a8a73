import getpass
import os
import tempfile

# 8 simulated CPU devices for the sharding tests; must be set before JAX initialises.
# (--xla_backend_optimization_level=0 was tried: compiling got faster, but the tests that compute
# ran 2-5x slower and the suite as long as before.)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent compilation cache for every test and every `python -m launch...` subprocess they
# start (inherited through the environment): the suite compiles the same tiny models again and
# again, in-process and in dozens of subprocesses. The key is the program and its compile
# options, so a changed program compiles afresh; the cache is capped and evicts the oldest.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"fibjax-test-jax-cache-{getpass.getuser()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 * 1024**3))
