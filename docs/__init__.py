"""Documentation tooling (python -m docs.gen); not part of the installed distribution."""
