"""Start an SGLang engine with some variables set for its processes only: the scheduler and the
detokenizer it spawns take this process's environment at that moment, so ``KVCANARY_*`` variables
set around the start reach them without staying set in the caller (the tests' and the benchmark's
engines, one after the other, each with its own)."""

import contextlib
import os


@contextlib.contextmanager
def environment(env, clear_prefix=None):
    """``env`` over ``os.environ`` inside the block (``None`` values unset), every variable starting
    with ``clear_prefix`` unset first; all as they were afterwards."""
    names = set(env) | {k for k in os.environ if clear_prefix and k.startswith(clear_prefix)}
    saved = {k: os.environ.get(k) for k in names}
    for k in names - set(env):
        os.environ.pop(k, None)
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start(model, env, clear_prefix=None, **args):
    """An ``sgl.Engine`` of ``model`` started with ``env`` set (see :func:`environment`)."""
    import sglang as sgl

    with environment(env, clear_prefix):
        return sgl.Engine(model_path=model, **args)
