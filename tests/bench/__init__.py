from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
