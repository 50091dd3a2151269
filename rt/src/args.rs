//! A rank executable's command line.

use std::path::PathBuf;
use std::time::Duration;

use crate::error::ExeError;

/// How to call a rank executable (printed with a usage error).
pub const USAGE: &str = "\
usage: rank<i> --tokens FILE --out DIR [--dir DIR] [--weights PATH | --seed N] [--timeout S]
  (one process a rank, under mpirun: mpirun -np 1 DIR/rank0 ARGS : -np 1 DIR/rank1 ARGS ...;
   `pleat run DIR` does this for you)
  --tokens FILE   token ids as JSON, [[id, ...], ...], one row a sequence (the plan's batch x seq)
  --out DIR       where to write rank<i>.outcome.json and rank<i>.outcome.safetensors
  --dir DIR       the compiled directory holding rank<i>.program (default: the executable's)
  --weights PATH  a .safetensors file, a model.safetensors.index.json, or a directory with either
  --seed N        seed of the synthetic weights when no --weights is given (default 0)
  --timeout S     seconds a rank waits on a message before it reports the peer (default 120)";

/// A rank executable's arguments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExeArgs {
    /// The compiled directory (`None`: the executable's own).
    pub dir: Option<PathBuf>,
    /// The token ids' JSON file.
    pub tokens: PathBuf,
    /// Where the outcome goes.
    pub out: PathBuf,
    /// Weights' file or directory (`None`: seeded synthetic weights).
    pub weights: Option<PathBuf>,
    /// Seed of the synthetic weights.
    pub seed: u64,
    /// How long a rank waits on a message.
    pub timeout: Duration,
}

impl ExeArgs {
    /// Parses `words` (the program's name first).
    pub fn parse(words: &[String]) -> Result<ExeArgs, ExeError> {
        let usage = |message: String| ExeError::Usage(message);
        let (mut dir, mut tokens, mut out, mut weights, mut seed, mut timeout) = (None, None, None, None, 0, 120);
        let mut rest = words.iter().skip(1);
        while let Some(flag) = rest.next() {
            let mut value = || rest.next().cloned().ok_or_else(|| usage(format!("{flag} needs a value")));
            let number = |text: String| {
                text.parse::<u64>().map_err(|_| usage(format!("{flag} takes a whole number, not {text:?}")))
            };
            match flag.as_str() {
                "--dir" => dir = Some(PathBuf::from(value()?)),
                "--tokens" => tokens = Some(PathBuf::from(value()?)),
                "--out" => out = Some(PathBuf::from(value()?)),
                "--weights" => weights = Some(PathBuf::from(value()?)),
                "--seed" => seed = number(value()?)?,
                "--timeout" => timeout = number(value()?)?,
                other => return Err(usage(format!("unknown argument {other:?}"))),
            }
        }
        Ok(ExeArgs {
            dir,
            tokens: tokens.ok_or_else(|| usage("--tokens FILE is required".into()))?,
            out: out.ok_or_else(|| usage("--out DIR is required".into()))?,
            weights,
            seed,
            timeout: Duration::from_secs(timeout),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(line: &str) -> Vec<String> {
        std::iter::once("rank0").chain(line.split_whitespace()).map(str::to_string).collect()
    }

    #[test]
    fn every_flag_is_read() {
        let args = ExeArgs::parse(&words("--tokens t.json --out o --dir d --weights w --seed 7 --timeout 9"))
            .expect("a good line");
        assert_eq!(
            args,
            ExeArgs {
                dir: Some("d".into()),
                tokens: "t.json".into(),
                out: "o".into(),
                weights: Some("w".into()),
                seed: 7,
                timeout: Duration::from_secs(9),
            }
        );
    }

    #[test]
    fn a_bad_line_is_a_usage_error_that_names_the_flag() {
        for (line, expected) in [
            ("--out o", "--tokens FILE is required"),
            ("--tokens t", "--out DIR is required"),
            ("--tokens t --out o --seed x", "--seed takes a whole number"),
            ("--tokens t --out o --timeout", "--timeout needs a value"),
            ("--tokens t --out o --frobnicate", "unknown argument \"--frobnicate\""),
        ] {
            let error = ExeArgs::parse(&words(line)).expect_err(line);
            assert!(matches!(&error, ExeError::Usage(message) if message.contains(expected)), "{line}: {error}");
        }
    }
}
