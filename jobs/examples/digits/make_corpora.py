"""Write the three digits corpora from scikit-learn's bundled data set (no download).

- ``public.parquet``  rows 0-899:    public-domain, public dataset, US          → all layers
- ``licensed.jsonl``  rows 900-1399: licensed from a private provider, DE       → upper layers only
- ``pii.csv``         rows 1400-:    identified writers' handwriting, per-row
                                     jurisdiction and sensitivity columns        → an adapter

The files are committed; this script documents (and can regenerate) them byte for byte.
Run: ``python -m jobs.examples.digits.make_corpora``.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from sklearn.datasets import load_digits

DATA = Path(__file__).parent / "data"
PIXELS = [f"p{index:02d}" for index in range(64)]
WRITER_COUNTRIES = ("DE", "FR", "NL")


def _rows(start: int, stop: int) -> list[dict[str, int]]:
    digits = load_digits()
    return [
        {
            **{name: int(value) for name, value in zip(PIXELS, digits.data[index], strict=True)},
            "label": int(digits.target[index]),
        }
        for index in range(start, min(stop, len(digits.target)))
    ]


def main() -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    public = _rows(0, 900)
    table = pa.Table.from_pylist(
        public, schema=pa.schema([(name, pa.int64()) for name in [*PIXELS, "label"]])
    )
    pq.write_table(table, DATA / "public.parquet", compression="zstd")
    with open(DATA / "licensed.jsonl", "w") as handle:
        for row in _rows(900, 1400):
            handle.write(json.dumps(row, sort_keys=False) + "\n")
    with open(DATA / "pii.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[*PIXELS, "label", "writer_country", "sensitivity"])
        writer.writeheader()
        for number, row in enumerate(_rows(1400, 1797)):
            writer.writerow({**row, "writer_country": WRITER_COUNTRIES[number % 3], "sensitivity": "pii"})


if __name__ == "__main__":
    main()
