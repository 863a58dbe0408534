"""A module that is not a verifiers environment: no load_environment."""


def make_env():
    return None
