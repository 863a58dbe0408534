"""docs/train.md's key tables are generated from the code (`python -m splitproof.rl.config.docs`): up to date."""

from pathlib import Path

from splitproof.rl.config import docs as config_docs
from splitproof.rl.config.schema import DataConfig, TrainConfig, field_comments, schema_keys

TRAIN_DOC = Path(__file__).resolve().parents[1] / "docs" / "train.md"


def test_train_doc_tables_are_up_to_date():
    text = TRAIN_DOC.read_text()
    assert config_docs.replace_section(text, config_docs.generated_section()) == text, (
        "run: python -m splitproof.rl.config.docs --write docs/train.md"
    )


def test_table_rows_come_from_the_schema_and_its_comments():
    rows = config_docs.keys_table().splitlines()[2:]
    assert [row.split("`")[1] for row in rows] == list(schema_keys(TrainConfig))
    train_files = next(row for row in rows if row.startswith("| `data.train_files`"))
    assert field_comments(DataConfig)["train_files"] in train_files
    batch = next(row for row in rows if row.startswith("| `data.train_batch_size`"))
    assert batch.split(" | ")[1:3] == ["`1024`", "`128`"]  # verl's default, the built-in model's recipe
