"""The documentation says what the code does: docs/options.md's options table is the one
`options.markdown_table()` makes from the option definitions, and the README opens with the two commands
CI and a new user run."""

from __future__ import annotations

from pathlib import Path

from spark_amqp import options

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
OPTIONS_PAGE = (ROOT / "docs" / "options.md").read_text(encoding="utf-8")


def test_options_table_is_the_one_made_from_the_option_definitions():
    table = options.markdown_table()
    assert table in OPTIONS_PAGE, ("docs/options.md's options table differs from spark_amqp.options.OPTIONS: "
                                   "paste `python -c 'from spark_amqp import options; "
                                   "print(options.markdown_table())'`")
    assert OPTIONS_PAGE.count("| option | applies to |") == 1


def test_readme_opens_with_the_main_job_and_the_test_command():
    block = README.split("```bash\n", 1)[1].split("```", 1)[0]
    assert "python -m spark_amqp_demo" in block.splitlines()[0]
    assert "python -m pytest -q" in block.splitlines()[1]
    assert README.startswith("# spark-amqp\n\n```bash\n" + OPENING), "the README opens with the two commands"


OPENING = ("pip install -e . --config-settings editable_mode=strict && python -m spark_amqp_demo   # the main job\n"
           "pip install -e '.[test]' --config-settings editable_mode=strict && python -m pytest -q  # the tests\n"
           "```\n")
