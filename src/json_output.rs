//! The JSON documents the commands print under `--format json`.
//!
//! Each is an object with `schema_version`: [`SCHEMA_VERSION`] changes when a key is renamed or
//! removed or its meaning changes, not when a key is added, so that a script can check the one
//! number it was written against. (`plan` carries the cost model's version of its estimate,
//! `pleat_passes::cost::estimate::SCHEMA_VERSION`; the `bench` reports name theirs in `schema`,
//! e.g. `pleat.bench.comm/1`; files pleat reads back, such as `plan.json` and checkpoints, carry
//! `format_version`.)

use anyhow::Result;
use serde_json::Value;

/// The version of the JSON documents of `run`, `rank`, `explain`, `compare`, `schedule`, `search`
/// and of errors (`--format json`).
pub const SCHEMA_VERSION: u32 = 1;

/// `document` (an object) with its `schema_version`.
pub fn versioned(mut document: Value) -> Value {
    if let Some(object) = document.as_object_mut() {
        object.insert("schema_version".to_string(), SCHEMA_VERSION.into());
    }
    document
}

/// Prints `document` (an object) with its `schema_version`, pretty, on stdout.
pub fn print(document: Value) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(&versioned(document))?);
    Ok(())
}
