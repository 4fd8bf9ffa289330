//! `ferry lincheck FILE...`: checks register histories for linearizability
//! and prints one verdict line per file. A file is read as a ferry history
//! (`ferry_sim::history::History::to_text`) when it starts with its header,
//! as the history of a `ferry nemesis` run (JSON lines, its register
//! operations) when it starts with that header, and as a Jepsen history
//! otherwise.
//!
//! Exit status: 0 when every file was decided (linearizable or not), 1 when
//! some file could not be read or parsed, or its search hit its bound.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use ferry_sim::history::{History, TEXT_HEADER};
use ferry_sim::lincheck::{check_with, jepsen, CheckOptions, Verdict, Violation};

/// Arguments of `ferry lincheck`.
#[derive(clap::Args, Debug)]
pub struct LincheckArgs {
    /// Register histories: Jepsen's (`INFO  jepsen.util - PROCESS TYPE F
    /// VALUE` lines, one register per file), ferry's own text format (a
    /// file starting with `# ferry history v1`), or the `history.jsonl` of
    /// a `ferry nemesis` run.
    #[arg(required = true, value_name = "FILE")]
    pub files: Vec<PathBuf>,

    /// After each "not linearizable" line, print the longest legal ordering
    /// the search found and the operation that could not follow it.
    #[arg(long)]
    pub explain: bool,

    /// Search steps allowed per key before the file is reported undecided.
    #[arg(long, value_name = "STEPS", default_value_t = CheckOptions::default().steps_per_key_max)]
    pub steps_per_key_max: u64,
}

/// What became of one file.
#[derive(Debug)]
enum FileResult {
    /// Read, parsed and checked.
    Checked(Verdict),
    /// Could not be read or parsed.
    Error(String),
}

impl FileResult {
    fn is_decided(&self) -> bool {
        match self {
            FileResult::Checked(verdict) => verdict.is_decided(),
            FileResult::Error(_) => false,
        }
    }
}

/// Runs `ferry lincheck`.
pub fn run(args: LincheckArgs) -> ExitCode {
    let options = CheckOptions {
        steps_per_key_max: args.steps_per_key_max,
        ..CheckOptions::default()
    };
    let mut all_decided = true;
    for file in &args.files {
        let result = check_file(file, options);
        all_decided &= result.is_decided();
        println!("{}", verdict_line(file, &result));
        if let (true, FileResult::Checked(Verdict::NotLinearizable(violation))) =
            (args.explain, &result)
        {
            print!("{}", explanation(violation));
        }
    }
    if all_decided {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn check_file(file: &Path, options: CheckOptions) -> FileResult {
    let text = match std::fs::read_to_string(file) {
        Ok(text) => text,
        Err(error) => return FileResult::Error(format!("cannot read the file: {error}")),
    };
    if crate::nemesis::history::is_history(text.lines().next().unwrap_or_default()) {
        return match crate::nemesis::history::read(text.as_bytes())
            .map_err(|error| error.to_string())
            .and_then(|records| crate::nemesis::check::register_history(&records))
        {
            Ok(history) => FileResult::Checked(check_with(&history, options)),
            Err(error) => FileResult::Error(format!("not a nemesis history: {error}")),
        };
    }
    if text.starts_with(TEXT_HEADER) {
        return match History::from_text(&text) {
            Ok(history) => FileResult::Checked(check_with(&history, options)),
            Err(error) => FileResult::Error(format!("not a ferry history: {error}")),
        };
    }
    match jepsen::parse(&text) {
        Ok(history) => FileResult::Checked(check_with(&history, options)),
        Err(error) => FileResult::Error(format!("not a Jepsen register history: {error}")),
    }
}

fn verdict_line(file: &Path, result: &FileResult) -> String {
    let file = file.display();
    match result {
        FileResult::Checked(Verdict::Linearizable) => format!("{file}: linearizable"),
        FileResult::Checked(Verdict::NotLinearizable(_)) => format!("{file}: not linearizable"),
        FileResult::Checked(Verdict::Undecided { key, reason }) => {
            format!("{file}: undecided: key {key}: {reason} (raise --steps-per-key-max)")
        }
        FileResult::Checked(verdict @ Verdict::InvalidHistory { .. }) => {
            format!("{file}: error: {verdict}")
        }
        FileResult::Error(message) => format!("{file}: error: {message}"),
    }
}

fn explanation(violation: &Violation) -> String {
    let mut text = format!("  {violation}\n");
    text.push_str("  longest legal ordering found:\n");
    for (position, operation) in violation.linearized.iter().enumerate() {
        text.push_str(&format!(
            "    {:>4}. {}\n",
            position + 1,
            ferry_sim::lincheck::describe(operation)
        ));
    }
    text.push_str(&format!(
        "  cannot follow it: {}\n",
        ferry_sim::lincheck::describe(&violation.blocked)
    ));
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_file(name: &str, contents: &str) -> PathBuf {
        let path =
            std::env::temp_dir().join(format!("ferry-lincheck-test-{}-{name}", std::process::id()));
        std::fs::write(&path, contents).unwrap();
        path
    }

    fn line_for(name: &str, contents: &str) -> (String, bool) {
        let path = temp_file(name, contents);
        let result = check_file(&path, CheckOptions::default());
        let line = verdict_line(Path::new(name), &result);
        std::fs::remove_file(&path).unwrap();
        (line, result.is_decided())
    }

    #[test]
    fn prints_one_verdict_per_file() {
        let linearizable = "INFO  jepsen.util - 0\t:invoke\t:write\t1\n\
                            INFO  jepsen.util - 0\t:ok\t:write\t1\n\
                            INFO  jepsen.util - 1\t:invoke\t:read\tnil\n\
                            INFO  jepsen.util - 1\t:ok\t:read\t1\n";
        assert_eq!(
            line_for("a.log", linearizable),
            ("a.log: linearizable".to_string(), true)
        );
        let stale = "INFO  jepsen.util - 0\t:invoke\t:write\t1\n\
                     INFO  jepsen.util - 0\t:ok\t:write\t1\n\
                     INFO  jepsen.util - 1\t:invoke\t:read\tnil\n\
                     INFO  jepsen.util - 1\t:ok\t:read\tnil\n";
        assert_eq!(
            line_for("b.log", stale),
            ("b.log: not linearizable".to_string(), true)
        );
    }

    #[test]
    fn reports_errors_and_counts_them_undecided() {
        let (line, decided) = line_for("c.log", "INFO  jepsen.util - 0\t:ok\t:read\t3\n");
        assert_eq!(
            line,
            "c.log: error: not a Jepsen register history: line 1: \
             process 0 completes an operation it never invoked"
        );
        assert!(!decided);

        let missing = Path::new("/nonexistent/ferry-lincheck.log");
        let result = check_file(missing, CheckOptions::default());
        assert!(!result.is_decided());
        assert!(verdict_line(missing, &result)
            .starts_with("/nonexistent/ferry-lincheck.log: error: cannot read the file: "));
    }

    #[test]
    fn reports_an_exhausted_budget_as_undecided() {
        let mut text = String::new();
        for process in 0..8 {
            text.push_str(&format!(
                "INFO  jepsen.util - {process}\t:invoke\t:write\t{process}\n"
            ));
        }
        for process in 0..8 {
            text.push_str(&format!(
                "INFO  jepsen.util - {process}\t:ok\t:write\t{process}\n"
            ));
        }
        text.push_str("INFO  jepsen.util - 9\t:invoke\t:read\tnil\n");
        text.push_str("INFO  jepsen.util - 9\t:ok\t:read\t99\n");
        let path = temp_file("d.log", &text);
        let options = CheckOptions {
            steps_per_key_max: 10,
            ..CheckOptions::default()
        };
        let result = check_file(&path, options);
        std::fs::remove_file(&path).unwrap();
        assert!(!result.is_decided());
        assert_eq!(
            verdict_line(Path::new("d.log"), &result),
            "d.log: undecided: key 0: search step budget of 10 exhausted \
             (raise --steps-per-key-max)"
        );
    }

    #[test]
    fn explains_a_violation() {
        let stale = "INFO  jepsen.util - 0\t:invoke\t:write\t1\n\
                     INFO  jepsen.util - 0\t:ok\t:write\t1\n\
                     INFO  jepsen.util - 1\t:invoke\t:read\tnil\n\
                     INFO  jepsen.util - 1\t:ok\t:read\tnil\n";
        let path = temp_file("e.log", stale);
        let result = check_file(&path, CheckOptions::default());
        std::fs::remove_file(&path).unwrap();
        let FileResult::Checked(Verdict::NotLinearizable(violation)) = result else {
            panic!("expected a violation, got {result:?}");
        };
        let text = explanation(&violation);
        assert!(
            text.contains("1. client 0 write 1 => ok (invoked at 1, completed at 2)"),
            "{text}"
        );
        assert!(
            text.contains(
                "cannot follow it: client 1 read => ok nil (invoked at 3, completed at 4)"
            ),
            "{text}"
        );
    }
}
