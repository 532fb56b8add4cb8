import os
import re
import subprocess
import sys
import textwrap

import pytest

import configurator
from configurator import ConfigError, configure


def fresh():
    return {"batch_size": 16, "learning_rate": 3e-4, "device": "cuda", "compile": False, "stages": [],
            "lr_mult": {"old": 1.0}, "resume_from": "", "maybe": None}


def test_overrides_keep_types():
    g = fresh()
    configure(g, ["--batch_size=32", "--learning_rate=1", "--device=cpu", "--compile=True",
                  "--stages=[{'a': 1}]", "--lr_mult={'old': 0.5}"])
    assert g["batch_size"] == 32 and type(g["batch_size"]) is int
    assert g["learning_rate"] == 1.0 and type(g["learning_rate"]) is float  # an int may stand for a float
    assert g["device"] == "cpu"  # a bare word is a string
    assert g["compile"] is True
    assert g["stages"] == [{"a": 1}] and g["lr_mult"] == {"old": 0.5}


@pytest.mark.parametrize("arg, words", [
    ("--batch_size=3.5", ["batch_size", "int", "3.5"]),
    ("--compile=1", ["compile", "True or False"]),
    ("--learning_rate=fast", ["learning_rate", "not a valid Python literal"]),
    ("--batch_sise=8", ["unknown config key 'batch_sise'", "did you mean 'batch_size'"]),
    ("--batch_size", ["--key=value"]),
    ("--compile=true", ["compile must be True or False"]),  # said only 'not a valid Python literal'
])
def test_bad_overrides(arg, words):
    with pytest.raises(ConfigError) as e:
        configure(fresh(), [arg])
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


def test_config_file(tmp_path):
    f = tmp_path / "c.py"
    f.write_text("batch_size = 8\n_helper = 3\ndevice = 'cpu'\nimport math\nlearning_rate = math.sqrt(4) * 1e-4\n")
    g = fresh()
    configure(g, [str(f), "--batch_size=4"])
    assert g["batch_size"] == 4 and g["device"] == "cpu" and abs(g["learning_rate"] - 2e-4) < 1e-12


@pytest.mark.parametrize("body, words", [
    ("lerning_rate = 1e-3\n", ["unknown config key 'lerning_rate'", "learning_rate", "c.py"]),
    ("batch_size = (\n", ["c.py:", "syntax error", "; fix the config file"]),
    ("batch_size = 'big'\n", ["batch_size must be an int"]),
    ("x = 1 / 0\n", ["c.py", "ZeroDivisionError", "; fix the config file"]),
    ("del batch_size\n", ["c.py", "deletes config key 'batch_size'"]),  # was a KeyError traceback
    ("steps_per_stage = 3\n", ["unknown config key 'steps_per_stage'", "call it _steps_per_stage"]),  # a helper
    ("lerning_rate = {3e-4}\n", ["unknown config key 'lerning_rate'", "learning_rate"]),  # a set: silently ignored
    ("lerning_rate = 3e-4j\n", ["unknown config key 'lerning_rate'"]),  # (complex, bytes: not data types it knew)
    ("device_name = b'cpu'\n", ["unknown config key 'device_name'"]),
])
def test_bad_config_file(tmp_path, body, words):
    f = tmp_path / "c.py"
    f.write_text(body)
    with pytest.raises(ConfigError) as e:
        configure(fresh(), [str(f)])
    for w in words:
        assert w in str(e.value)


def test_a_config_file_that_exits_is_not_binary_or_has_a_nul_is_one_line_naming_it(tmp_path):
    """sys.exit(0) in a config file ended train.py (and container.py --random-config) with exit 0, nothing done and
    nothing said; a NUL byte said "c.py:None: syntax error"."""
    f = tmp_path / "c.py"
    for body, words in [(b"import sys\nsys.exit(0)\n", "calls sys.exit(0); a config file only sets keys"),
                        (b"raise SystemExit('x')\n", "calls sys.exit('x')"),
                        (b"batch_size = 4\x00\n", f"{f}: syntax error"),
                        (b"\xff\xfebatch_size = 4\n", "not UTF-8 text (byte 0: invalid start byte); save it as UTF-8")]:
        f.write_bytes(body)
        with pytest.raises(ConfigError) as e:
            configure(fresh(), [str(f)])
        assert str(e.value).startswith(str(f)) and words in str(e.value) and "None" not in str(e.value), e.value
    f.write_bytes(b"import sys\nsys.exit(0)\n")
    r = subprocess.run([sys.executable, "container.py", "--random-config", str(f), "--out", str(tmp_path / "r.pcf4")],
                       cwd=configurator.__file__.rsplit("/", 1)[0], capture_output=True, text=True)
    assert r.returncode == 1 and "calls sys.exit(0)" in r.stderr and not os.path.exists(tmp_path / "r.pcf4"), r.stderr


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        configure(fresh(), ["config/nope.py"])
    with pytest.raises(ConfigError, match="is a directory; pass a config file"):  # it said 'not found'
        configure(fresh(), [str(tmp_path)])


def test_a_config_file_setting_the_value_already_there_says_so(tmp_path):
    """An assignment was noticed by identity, so `compile = False` over a default of False (small ints, True/False,
    short strings are shared objects) was not counted as set: train.py's checks of what a file sets skipped it."""
    f = tmp_path / "c.py"
    f.write_text("batch_size = 16\ncompile = False\ndevice = 'cuda'\nlearning_rate = 3e-4\nstages = []\n")
    assert [k for k, _ in configure(fresh(), [str(f)])] == ["batch_size", "compile", "device", "learning_rate", "stages"]


def test_configure_or_exit_is_one_line(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(configurator.__file__.rsplit('/', 1)[0])!r})
        import configurator
        batch_size = 1
        configurator.configure_or_exit(globals(), sys.argv[1:])
    """))
    r = subprocess.run([sys.executable, str(script), "--batch_size=x"], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "batch_size" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("body,ok", [
    ("lr = 6 * 10**-4\nbatch = 2**20\ndecay = -2**3\nrates = dict(a=1e-3, b=[1, 2])", True),
    ("x = 9**9**9", False),  # would hang the trainer that execs it
    ("x = 'a' * 10**12", False),  # would fill its memory
    ("x = [0] * 10**12", False),
    ("x = (2**64)**64", False),
    ("n = 2**depth", False),
    ("import os", False),
    ("dict = open\nx = dict(file='victim', mode='w')", False),  # passed: a builtin called through dict(...)
    ("a = [0]\nb = a * 10**12", False),  # passed: the repetition of a list held in a name
    ("s = 'x'\nt = s * 10**12", False),
    ("a = 10**64\nb = a * a\nc = b * b\nd = c * c\ne = d * d\nf = e * e\ng = f * f", False),  # squaring
    ("s = 'x' * 1000\n" + "s = s + s\n" * 40, False),  # doubling
    ("x = '%0999999999d' % 1", False),  # a gigabyte of zeros
    ("x = open('f')", False),
    ("compile = False\nn = 3\nstages = [dict(name='w', steps=n * 2), dict(name='s', mix={'a': 0.5}, tokens=2e9)]", True),
    ("x = " + "1 + " * 1000 + "1", False),  # a RecursionError (relay's pull: a traceback, the lease kept)
    ("x.y = " + "1 + " * 600 + "1", False),
    ("x = " + "-" * 10000 + "1", False),  # a MemoryError from the parser
    ("x = 0x" + "f" * 5000, False),  # a ValueError traceback: unparse of an int past Python's 4300 digits
    ("x = [0x" + "f" * 5000 + "]\nimport os", False),
    # each container small, the whole a billion laughs: train.py's repr of it (its error names the value), a
    # json.dump into state.json, hung or filled the memory of every contributor that pulled it
    ("_a = ['a/b'] * 100000\n_b = [_a] * 100000\nquarantine_shards = _b", False),
    ("s = 'x' * 100000\nt = [s] * 100000", False),
    ("a = [0x" + "f" * 1000 + "] * 100000", False),  # 1,200 digits each
    ("a = [0]\n" + "a = [a]\n" * 5000, False),  # nested past repr's and json's depth: a RecursionError traceback
    ("a = [0] * 100000\nb = [1, a, a]\nrates = dict(a=b, c={'k': [b]})", True),
])
def test_a_config_from_another_machine_must_be_quick_plain_data(body, ok):
    """configurator.not_data, which relay.py applies to the run's config.py before train.py execs it: literals and
    arithmetic only, and no arithmetic that takes long to compute (a huge power or repetition)."""
    assert (configurator.not_data(body) is None) == ok


def test_the_items_of_a_list_tuple_or_dict_keep_the_default_items_kind(tmp_path):
    """Only the outer type was checked: --lr_mult={'old': 'x'} trained into a traceback (exit 10: restarted)."""
    g = {"betas": (0.9, 0.95), "lr_mult": {"old": 1.0, "new": 1.0}, "batch_size": 16, "flag": False}
    for arg, words in [("--betas=['a','b']", "betas[0] must be a float"), ("--betas=(1, 2, 3)", "must hold 2 items"),
                       ("--lr_mult={'old': 'x'}", "lr_mult['old'] must be a float"),
                       ("--batch_size=True", "batch_size must be an int"), ("--flag=1", "flag must be True or False")]:
        with pytest.raises(ConfigError, match=re.escape(words)):
            configure(dict(g), [arg])
    h = dict(g)
    configure(h, ["--betas=[1, 0.5]", "--lr_mult={'new': 2}"])
    assert h["betas"] == (1.0, 0.5) and h["lr_mult"] == {"old": 1.0, "new": 2.0}
    f = tmp_path / "c.py"  # a config file's mistake names the file
    f.write_text("batch_size = '16'\n")
    with pytest.raises(ConfigError, match=re.escape(f"{f}: batch_size must be an int")):
        configure(dict(g), [str(f)])


def test_none_only_where_the_default_is_none_and_string_keys_take_the_text():
    g = {"out_dir": "out", "seq_len": 32, "mirror_dir": "", "maybe": None}
    for arg, words in [("--seq_len=None", "seq_len must be an int"), ("--out_dir=None", "--out_dir= for an empty")]:
        with pytest.raises(ConfigError, match=words):
            configure(dict(g), [arg])
    h = dict(g)
    configure(h, ["--out_dir=2024", "--mirror_dir=True", "--maybe=None"])
    assert h["out_dir"] == "2024" and h["mirror_dir"] == "True" and h["maybe"] is None
    configure(h, ["--out_dir='runs/a b'"])
    assert h["out_dir"] == "runs/a b"


def test_an_override_before_a_config_file_that_sets_it_is_refused(tmp_path):
    """Applied in order, `--batch_size=4 c.py` trained at c.py's batch size: the user's override lost, unsaid."""
    f = tmp_path / "c.py"
    f.write_text("batch_size = 16\ndevice = 'cuda'\n")
    with pytest.raises(ConfigError) as e:
        configure(fresh(), ["--batch_size=4", str(f)])
    assert str(e.value) == f"--batch_size=4 is given before {f}, which sets batch_size too and would replace it; put " \
                           f"--batch_size=4 after {f}"
    g = fresh()  # an override the file leaves alone may come first; one after the file wins, as before
    assert configure(g, ["--learning_rate=0.5", str(f), "--batch_size=4"]) == [
        ("learning_rate", None), ("batch_size", str(f)), ("device", str(f)), ("batch_size", None)]
    assert (g["learning_rate"], g["batch_size"], g["device"]) == (0.5, 4, "cuda")


def test_a_dict_override_updates_the_dict_a_config_file_set(tmp_path):
    """--lr_mult="{'new': 2.0}" replaced the whole dict: the config file's 'old': 0.1 (a grown model's old layers at a
    tenth of the LR) silently went back to 1.0. An override updates the entries it names; a file's assignment is
    Python's (it replaces)."""
    g = {"lr_mult": {"embedding": 1.0, "old": 1.0, "new": 1.0}}
    f = tmp_path / "grow.py"
    f.write_text("lr_mult = {'embedding': 0.5, 'old': 0.1, 'new': 1.0}\n")
    configure(g, [str(f), "--lr_mult={'new': 2}"])
    assert g["lr_mult"] == {"embedding": 0.5, "old": 0.1, "new": 2.0}
    f.write_text("lr_mult = {'new': 3.0}\n")
    configure(g, [str(f)])
    assert g["lr_mult"] == {"new": 3.0}
