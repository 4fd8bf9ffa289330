//! Parser for Jepsen's register histories, as logged by `jepsen.util`:
//!
//! ```text
//! INFO  jepsen.util - 3 :invoke :cas [1 4]
//! INFO  jepsen.util - 3 :fail :cas [1 4]
//! ```
//!
//! (fields separated by tabs, or any whitespace). Each line is
//! `PROCESS TYPE F VALUE`. An `:invoke` opens an operation for
//! its process; the next `:ok`, `:fail` or `:info` line of that process
//! closes it. `:ok` becomes [`Outcome::Ok`], `:fail` becomes
//! [`Outcome::Fail`], and `:info` (outcome unknown, e.g. `:timed-out`)
//! becomes [`Outcome::Unknown`] with the value taken from the invocation.
//! An operation still open at the end of the file is unknown too. Time is
//! the line number, and every operation is on key 0 (a file is one
//! register). Lines of the `:nemesis` process (fault injection, not client
//! operations) and blank lines are skipped.

use std::collections::HashMap;

use crate::history::{History, OpKind, Operation, Outcome};

/// Longest excerpt of a bad line quoted in an error, so that a corrupt
/// multi-megabyte line does not end up in a terminal.
const EXCERPT_CHARS_MAX: usize = 80;

/// A line of a Jepsen history that could not be understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {problem}")]
pub struct ParseError {
    /// 1-based line number.
    pub line: u64,
    /// What is wrong with it.
    pub problem: ParseProblem,
}

/// What is wrong with a line (see [`ParseError`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseProblem {
    /// The line does not have the `jepsen.util - PROCESS TYPE F VALUE` shape.
    #[error("expected `INFO  jepsen.util - PROCESS<TAB>TYPE<TAB>F<TAB>VALUE`, found {found:?}")]
    Shape {
        /// The start of the line.
        found: String,
    },
    /// The process is not a number (or `:nemesis`).
    #[error("process {found:?} is not a non-negative integer")]
    Process {
        /// The process field.
        found: String,
    },
    /// The type is not one the register model knows.
    #[error("type {found:?} is not one of :invoke, :ok, :fail, :info")]
    Type {
        /// The type field.
        found: String,
    },
    /// The function is not one the register model knows.
    #[error("function {found:?} is not one of :read, :write, :cas")]
    Function {
        /// The function field.
        found: String,
    },
    /// The value does not fit the function.
    #[error("value {found:?} is not valid here: expected {expected}")]
    Value {
        /// The value field.
        found: String,
        /// What was expected instead.
        expected: &'static str,
    },
    /// A completion for a process with no open invocation.
    #[error("process {process} completes an operation it never invoked")]
    CompletionWithoutInvocation {
        /// The process.
        process: u64,
    },
    /// A second invocation while the process's previous one is open.
    #[error(
        "process {process} invokes an operation while its operation from line {open_line} is still open"
    )]
    InvocationWhileOpen {
        /// The process.
        process: u64,
        /// Where the open operation was invoked.
        open_line: u64,
    },
    /// A completion whose function or value differs from its invocation's.
    #[error(
        "process {process} completes `{found}` but invoked `{invoked}` on line {invoked_line}"
    )]
    CompletionMismatch {
        /// The process.
        process: u64,
        /// The function and value on this line.
        found: String,
        /// The function and value on the invocation line.
        invoked: String,
        /// Where it was invoked.
        invoked_line: u64,
    },
}

/// The four kinds of line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LineType {
    Invoke,
    Ok,
    Fail,
    Info,
}

/// The operation a line names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Function {
    Read,
    Write,
    Cas,
}

/// A function with its value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Call {
    /// A read: `nil` or the value read.
    Read(Option<u64>),
    /// A write of a value.
    Write(u64),
    /// A compare-and-set `[from to]`.
    Cas { from: u64, to: u64 },
}

impl Call {
    fn function(self) -> Function {
        match self {
            Call::Read(_) => Function::Read,
            Call::Write(_) => Function::Write,
            Call::Cas { .. } => Function::Cas,
        }
    }
}

/// An invocation waiting for its completion.
struct Open {
    line: u64,
    call: Call,
}

/// Parses a whole Jepsen register history.
pub fn parse(text: &str) -> Result<History, ParseError> {
    let mut history = History::default();
    let mut open: HashMap<u64, Open> = HashMap::new();
    for (index, raw) in text.lines().enumerate() {
        let line = index as u64 + 1;
        let fail = |problem| ParseError { line, problem };
        let raw = raw.trim();
        if raw.is_empty() {
            continue;
        }
        let Some((process, line_type, function, value)) = split(raw) else {
            return Err(fail(ParseProblem::Shape {
                found: excerpt(raw),
            }));
        };
        if process == ":nemesis" {
            continue;
        }
        let process: u64 = process.parse().map_err(|_| {
            fail(ParseProblem::Process {
                found: excerpt(process),
            })
        })?;
        let line_type = parse_type(line_type).map_err(fail)?;
        match line_type {
            LineType::Invoke => {
                let function = parse_function(function).map_err(fail)?;
                let call = parse_value(function, value).map_err(fail)?;
                if let Some(previous) = open.get(&process) {
                    return Err(fail(ParseProblem::InvocationWhileOpen {
                        process,
                        open_line: previous.line,
                    }));
                }
                open.insert(process, Open { line, call });
            }
            LineType::Ok | LineType::Fail | LineType::Info => {
                let Some(invocation) = open.remove(&process) else {
                    return Err(fail(ParseProblem::CompletionWithoutInvocation { process }));
                };
                let mismatch = || {
                    fail(ParseProblem::CompletionMismatch {
                        process,
                        found: excerpt(&format!("{function} {value}")),
                        invoked: render(invocation.call),
                        invoked_line: invocation.line,
                    })
                };
                if parse_function(function).map_err(fail)? != invocation.call.function() {
                    return Err(mismatch());
                }
                // `:fail` and `:info` lines carry no meaningful value (Jepsen
                // writes `:timed-out` and the like there), so only `:ok`
                // values are parsed: a read's is its result, and a write's or
                // CAS's must repeat the invocation's.
                let outcome = match line_type {
                    LineType::Ok => {
                        match parse_value(invocation.call.function(), value).map_err(fail)? {
                            Call::Read(read) => Outcome::Ok { read },
                            completed => {
                                if completed != invocation.call {
                                    return Err(mismatch());
                                }
                                Outcome::Ok { read: None }
                            }
                        }
                    }
                    LineType::Fail => Outcome::Fail,
                    LineType::Info | LineType::Invoke => Outcome::Unknown,
                };
                let completed_at = match outcome {
                    Outcome::Unknown => None,
                    Outcome::Ok { .. } | Outcome::Fail => Some(line),
                };
                history.operations.push(Operation {
                    client: process,
                    key: 0,
                    kind: kind_of(invocation.call),
                    invoked_at: invocation.line,
                    completed_at,
                    outcome,
                });
            }
        }
    }
    // Invocations never answered: the client cannot know their outcome.
    let mut unanswered: Vec<(u64, Open)> = open.into_iter().collect();
    unanswered.sort_by_key(|(_, open)| open.line);
    for (process, invocation) in unanswered {
        history.operations.push(Operation {
            client: process,
            key: 0,
            kind: kind_of(invocation.call),
            invoked_at: invocation.line,
            completed_at: None,
            outcome: Outcome::Unknown,
        });
    }
    Ok(history)
}

/// Splits a line into process, type, function and value (the value may
/// contain spaces, as `[1 4]` does).
fn split(line: &str) -> Option<(&str, &str, &str, &str)> {
    let marker = "jepsen.util";
    let after_marker = &line[line.find(marker)? + marker.len()..];
    let fields = after_marker.trim_start().strip_prefix('-')?;
    let mut rest = fields.trim_start();
    let mut take = || {
        let end = rest.find(char::is_whitespace)?;
        let (field, tail) = rest.split_at(end);
        rest = tail.trim_start();
        Some(field)
    };
    let process = take()?;
    let line_type = take()?;
    let function = take()?;
    let value = rest.trim_end();
    if value.is_empty() {
        return None;
    }
    Some((process, line_type, function, value))
}

fn parse_type(field: &str) -> Result<LineType, ParseProblem> {
    match field {
        ":invoke" => Ok(LineType::Invoke),
        ":ok" => Ok(LineType::Ok),
        ":fail" => Ok(LineType::Fail),
        ":info" => Ok(LineType::Info),
        other => Err(ParseProblem::Type {
            found: excerpt(other),
        }),
    }
}

fn parse_function(field: &str) -> Result<Function, ParseProblem> {
    match field {
        ":read" => Ok(Function::Read),
        ":write" => Ok(Function::Write),
        ":cas" => Ok(Function::Cas),
        other => Err(ParseProblem::Function {
            found: excerpt(other),
        }),
    }
}

fn parse_value(function: Function, value: &str) -> Result<Call, ParseProblem> {
    let value_error = |expected| ParseProblem::Value {
        found: excerpt(value),
        expected,
    };
    match function {
        Function::Read => {
            if value == "nil" {
                return Ok(Call::Read(None));
            }
            let read = value
                .parse()
                .map_err(|_| value_error("`nil` or a non-negative integer"))?;
            Ok(Call::Read(Some(read)))
        }
        Function::Write => {
            let written = value
                .parse()
                .map_err(|_| value_error("a non-negative integer"))?;
            Ok(Call::Write(written))
        }
        Function::Cas => {
            let expected = "`[FROM TO]` with non-negative integers";
            let inner = value
                .strip_prefix('[')
                .and_then(|v| v.strip_suffix(']'))
                .ok_or_else(|| value_error(expected))?;
            let mut parts = inner.split_whitespace();
            let (Some(from), Some(to), None) = (parts.next(), parts.next(), parts.next()) else {
                return Err(value_error(expected));
            };
            let from = from.parse().map_err(|_| value_error(expected))?;
            let to = to.parse().map_err(|_| value_error(expected))?;
            Ok(Call::Cas { from, to })
        }
    }
}

fn kind_of(call: Call) -> OpKind {
    match call {
        Call::Read(_) => OpKind::Read,
        Call::Write(value) => OpKind::Write(value),
        Call::Cas { from, to } => OpKind::Cas { from, to },
    }
}

fn render(call: Call) -> String {
    match call {
        Call::Read(_) => ":read".to_string(),
        Call::Write(value) => format!(":write {value}"),
        Call::Cas { from, to } => format!(":cas [{from} {to}]"),
    }
}

fn excerpt(text: &str) -> String {
    if text.chars().count() <= EXCERPT_CHARS_MAX {
        return text.to_string();
    }
    let mut short: String = text.chars().take(EXCERPT_CHARS_MAX).collect();
    short.push('…');
    short
}
