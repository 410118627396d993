"""`vlmrl` CLI with tests/ importable, for the test-only environment env._target_=resume_envs.ScoredEnv."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vlmrl.cli import main

if __name__ == "__main__":
    main()
