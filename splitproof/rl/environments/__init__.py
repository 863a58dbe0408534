"""Environments in the shapes people write them: TRL's ``environment_factory`` (``trl_factory``), a batch's
instances in episodes (``session``), their seeds (``seeds``), their rewards (``rewards``), the checks
before any model (``setup``). See docs/environments.md."""
