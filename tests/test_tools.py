"""Tool calls by hand: the Hermes ``<tool_call>`` parser (valid, malformed, several calls, an
unclosed tag), the calculator (exact values, refused expressions) and the Python tool (output,
errors, limits), and dispatch with its error texts."""

from __future__ import annotations

import pytest

from alignment.envs.tool_calls import ToolCall, parse_tool_calls
from alignment.data.step_labels import evaluate_arithmetic
from alignment.envs.tools import TOOLS, calculator, python_tool, run_tool


def test_parse_valid_and_several_calls():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n'
            '</tool_call>\nand <tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>')
    parsed = parse_tool_calls(text)
    assert parsed.calls == [ToolCall("calculator", {"expression": "12 * 7"}), ToolCall("python", {"code": "print(1)"})]
    assert parsed.errors == [None, None] and parsed.any
    assert parse_tool_calls('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>').calls == [
        ToolCall("f", {"x": 1})]  # "parameters" as some templates write it
    assert not parse_tool_calls("The answer is 84.").any


@pytest.mark.parametrize("body,message", [
    ('{"name": "calculator", "arguments": {"expression": "1+1"}', "not valid JSON"),
    ('{"arguments": {"expression": "1+1"}}', 'needs a "name" string'),
    ('["calculator"]', 'needs a "name" string'),
    ('{"name": "calculator", "arguments": "1+1"}', '"arguments" is a string that is not a JSON object'),
    ('{"name": "calculator", "arguments": [1]}', '"arguments" must be a JSON object'),
])
def test_malformed_calls_become_messages_for_the_model(body, message):
    parsed = parse_tool_calls(f"ok <tool_call>{body}</tool_call>")
    assert parsed.calls == [None] and message in parsed.errors[0]
    assert parsed.errors[0].startswith("tool call 1: ") and '<tool_call>{"name": "<tool>"' in parsed.errors[0]


def test_an_unclosed_call_is_one_more_malformed_call():
    parsed = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {"expression": "2"}}</tool_call>'
                              '<tool_call>{"name": "calculator"')
    assert parsed.calls[0] == ToolCall("calculator", {"expression": "2"}) and parsed.calls[1] is None
    assert parsed.errors[1] == ('tool call 2: <tool_call> without </tool_call>; write '
                                '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>')


def test_calculator_is_exact_and_refuses_code():
    assert calculator("(12 + 7) * 3") == "57" and calculator("7 / 2") == "3.5" and calculator("8 / 2") == "4"
    assert calculator("123456789 * 987654321") == "121932631112635269"  # exact integers
    assert calculator("-2 ** 3 + 17 // 5 - 17 % 5") == "-7"
    assert calculator("1 / 0") == "Error: division by zero"
    assert calculator("__import__('os').system('ls')").startswith("Error: ")
    assert calculator("2 ** 1000") == "Error: exponent 1000 is larger than 100"
    assert calculator("x + 1") == "Error: 'x' is not a number or + - * / // % ** of numbers"
    assert calculator("1 +").startswith("Error: not an arithmetic expression")
    assert evaluate_arithmetic("0.5 + 0.25") == 0.75


def test_python_tool_runs_in_the_sandbox():
    assert python_tool("print(sum(range(101)))") == "5050\n"
    assert python_tool("x = 1") == "(no output: print the result)"
    assert python_tool("print('a')\n1 / 0") == "a\nError: ZeroDivisionError: division by zero"
    assert python_tool("import time; time.sleep(30)") == "Error: timed out after 5 s"
    assert python_tool("import os; os.system('ls')") == "Error: PermissionError: sandbox: os.system is not allowed"
    out = python_tool("print('x' * 5000)")
    assert out == "x" * 2000 + "\n[output truncated]"


def test_dispatch_and_its_errors():
    assert run_tool(ToolCall("calculator", {"expression": "6 * 7"})) == "42"
    assert run_tool(ToolCall("search", {"q": "x"})) == "Error: unknown tool 'search'; available: calculator, python"
    assert run_tool(ToolCall("calculator", {"expr": "1"})) == ("Error: calculator takes one argument, 'expression'; "
                                                               "got ['expr']")
    assert TOOLS["python"].schema()["function"]["parameters"]["required"] == ["code"]
