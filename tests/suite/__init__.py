"""What the whole suite shares about its own running: which skips are allowed (`skips`) and where the
pinned command-line tools are (`tools`). Importable as `suite` (tests/conftest.py puts tests/ first on
sys.path)."""
