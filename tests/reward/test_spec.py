"""Reward spec parsing: the text and dict forms, formatting back, versions, and each spec error."""

from __future__ import annotations

import pytest

from rlfleet.reward.errors import RewardSpecError, UnknownReward
from rlfleet.reward.registry import parse_reward_spec
from rlfleet.reward.spec import ComponentSpec, RewardSpec, format_reward_spec, parse_value


def test_single_rule_with_args() -> None:
    spec = parse_reward_spec("concise:max_words=50")
    assert spec.components == [ComponentSpec(name="concise", weight=1.0, args={"max_words": 50})]
    assert spec.revision == 0


def test_weighted_sum() -> None:
    spec = parse_reward_spec("0.7*concise:max_words=50 + 0.3*relevance")
    assert [(c.name, c.weight, c.args) for c in spec.components] == [
        ("concise", 0.7, {"max_words": 50}),
        ("relevance", 0.3, {}),
    ]


def test_negative_and_scientific_weights_and_spacing() -> None:
    spec = parse_reward_spec("  numeric +-0.5 * length_penalty:max_words=10 + 1e-2*charset:allowed=01 ")
    assert [c.weight for c in spec.components] == [1.0, -0.5, 0.01]


def test_digits_with_a_leading_zero_stay_a_string() -> None:
    assert parse_reward_spec("charset:allowed=0123456789").components[0].args == {"allowed": "0123456789"}
    assert parse_reward_spec("charset:allowed='123'").components[0].args == {"allowed": "123"}
    assert parse_reward_spec("charset:allowed=123").components[0].args == {"allowed": 123}


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("50", 50),
        ("-3", -3),
        ("0", 0),
        ("007", "007"),
        ("0.25", 0.25),
        ("0.5", 0.5),
        ("1e-3", 0.001),
        ("true", True),
        ("False", False),
        ("linear", "linear"),
        ("'42'", "42"),
        ('"a,b"', "a,b"),
        ("nan", "nan"),
        ("a|b", "a|b"),
    ],
)
def test_parse_value_types(text: str, value: object) -> None:
    got = parse_value(text)
    assert got == value
    assert type(got) is type(value)


def test_quoted_values_may_hold_separators() -> None:
    spec = parse_reward_spec("regex:pattern='^\\d+(,\\d+)*$',full=true + keyword:keywords=\"a+b\"")
    regex, keyword = spec.components
    assert regex.args == {"pattern": r"^\d+(,\d+)*$", "full": True}
    assert keyword.args == {"keywords": "a+b"}


def test_user_functions_with_and_without_args() -> None:
    spec = parse_reward_spec("mypkg.rewards:my_fn + 0.5*mod:fn:scale=2,name=x")
    first, second = spec.components
    assert (first.name, first.args, first.is_user_function) == ("mypkg.rewards:my_fn", {}, True)
    assert (second.name, second.weight, second.args) == ("mod:fn", 0.5, {"scale": 2, "name": "x"})


def test_dict_form() -> None:
    spec = parse_reward_spec(
        {
            "components": [
                {"name": "concise", "weight": 0.7, "args": {"max_words": 50}},
                {"name": "keyword", "args": {"keywords": ["a", "b"]}, "label": "kw"},
                {"name": "pkg.mod:fn"},
            ],
            "revision": 3,
        }
    )
    assert [c.name for c in spec.components] == ["concise", "keyword", "pkg.mod:fn"]
    assert spec.components[1].args == {"keywords": ["a", "b"]}
    assert spec.components[1].label == "kw"
    assert spec.components[2].weight == 1.0
    assert spec.revision == 3


def test_revision_override_and_version() -> None:
    a = parse_reward_spec("0.7*concise + 0.3*relevance")
    b = parse_reward_spec(" 0.70 * concise+0.3*relevance ")
    assert a.version == b.version
    assert a.version.endswith("-r0")
    assert parse_reward_spec(a, revision=2).version == a.version.replace("-r0", "-r2")
    assert parse_reward_spec("0.6*concise + 0.3*relevance").version != a.version
    assert (
        parse_reward_spec("concise:max_words=51").version != parse_reward_spec("concise:max_words=50").version
    )


@pytest.mark.parametrize(
    "text",
    [
        "0.7*concise:max_words=50 + 0.3*relevance",
        r"regex:pattern='^\d+,\d+$',full=true",
        "keyword:keywords='new york|paris',mode=all + -0.25*length_penalty:max_words=10",
        "charset:allowed='0123456789' + mod.sub:fn:k=v,x=1.5",
        'keyword:keywords="it\'s"',
    ],
)
def test_format_round_trip(text: str) -> None:
    spec = parse_reward_spec(text)
    again = parse_reward_spec(format_reward_spec(spec))
    assert again == spec
    assert str(spec) == format_reward_spec(spec)


def test_format_refuses_what_the_text_form_cannot_hold() -> None:
    both_quotes = RewardSpec(components=[ComponentSpec(name="keyword", args={"keywords": 'it\'s "x"'})])
    with pytest.raises(ValueError, match="both quote"):
        format_reward_spec(both_quotes)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("", "empty component"),
        ("concise +", "empty component"),
        ("concise ++ relevance", "empty component"),
        ("concise:max_words", "not key=value"),
        ("concise:max_words=", "has no value"),
        ("concise:max_words=1,max_words=2", "given twice"),
        ("concise:9x=1", "not an identifier"),
        ("x*concise", "not \\[weight\\*\\]name"),
        ("keyword:keywords='abc", "unclosed ' quote"),
        ({"components": []}, "components"),
        ({"components": [{"name": "concise", "wieght": 2}]}, "wieght"),
        ({"components": [{"name": "concise", "weight": "heavy"}]}, "weight"),
        ({"components": [{"name": "bad name!"}]}, "neither a rule name"),
        ({"parts": []}, "parts"),
        (["concise"], "expected a str or a dict"),
    ],
)
def test_bad_specs_raise_spec_errors(spec: object, match: str) -> None:
    with pytest.raises(RewardSpecError, match=match):
        parse_reward_spec(spec)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "spec",
    ["consise:max_words=5", "0.5*concise + nope", "mypkg.rewards", {"components": [{"name": "nope"}]}],
)
def test_unknown_rule_names_list_the_known_ones(spec: object) -> None:
    with pytest.raises(UnknownReward, match="registered rules are charset, concise") as info:
        parse_reward_spec(spec)  # type: ignore[arg-type]
    assert info.value.name in {"consise", "nope", "mypkg.rewards"}
    assert isinstance(info.value, ValueError)
