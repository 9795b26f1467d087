"""Helpers for the test-only stand-ins in this folder (sgl_kernel, torchvision): a name the engine
imports but the CPU torch-native path never calls is a function that raises when called."""


class StandInError(NotImplementedError):
    pass


def unsupported(module, name):
    def call(*args, **kwargs):
        raise StandInError(f"{module}.{name} was called, but {module} here is kvcanary's test stand-in "
                           f"(tests_sglang/stubs/), which implements only what SGLang's CPU engine calls on "
                           f"the torch_native attention path")
    call.__name__ = call.__qualname__ = name
    call.__module__ = module
    return call
