//! The `config.json` reader: walks the `serde_json::Value` field by field, so that every error names the
//! field, and applies the per-architecture defaults of transformers' config classes.
//!
//! It only reads; [`ModelConfig::validate`] then checks sizes and consistency.

use serde_json::{Map, Value};

use super::{
    bad_value, Architecture, ConfigDtype, ConfigError, ModelConfig, MoeConfig, Result, RopeConfig, RopeScaling,
};

/// Parses `text` and reads every field; [`ModelConfig::validate`] checks the numbers afterwards.
pub(super) fn read_config(text: &str, source: &str) -> Result<ModelConfig> {
    let value: Value = serde_json::from_str(text).map_err(|error| malformed(source, &error))?;
    let Value::Object(object) = &value else {
        return Err(ConfigError::NotAnObject { file: source.to_owned(), found: abbreviate(&value) });
    };
    read_fields(&Fields { file: source, object, prefix: String::new() })
}

/// Reads the fields of the top-level object.
fn read_fields(fields: &Fields<'_>) -> Result<ModelConfig> {
    let architecture = read_architecture(fields)?;
    let vocab_size = fields.required_u64("vocab_size")?;
    let hidden_size = fields.required_u64("hidden_size")?;
    let num_layers = fields.required_u64("num_hidden_layers")?;
    let num_heads = fields.required_u64("num_attention_heads")?;
    let intermediate_size = fields.required_u64("intermediate_size")?;
    let num_kv_heads = read_num_kv_heads(fields, architecture, num_heads)?;
    let head_dim = match fields.optional_u64("head_dim")? {
        Some(head_dim) => head_dim,
        None if num_heads != 0 && hidden_size % num_heads != 0 => {
            return Err(ConfigError::HeadDimNotDerivable { file: fields.file.to_owned(), hidden_size, num_heads });
        }
        None => hidden_size.checked_div(num_heads).unwrap_or(0),
    };
    let hidden_act = fields.optional_str("hidden_act")?.unwrap_or("silu");
    if hidden_act != "silu" {
        return Err(fields.unsupported(
            "hidden_act",
            &format!("\"{hidden_act}\""),
            "pleat builds gated SiLU MLPs (hidden_act \"silu\")",
        ));
    }
    let attention_bias = read_attention_bias(fields, architecture)?;
    let default_max_positions = match architecture {
        Architecture::Llama => 2048,
        Architecture::Mistral | Architecture::Mixtral => 4096 * 32,
        Architecture::Qwen2 | Architecture::Qwen2Moe => 32768,
    };
    let default_eps = if architecture == Architecture::Mixtral { 1e-5 } else { 1e-6 };
    let default_theta = if architecture == Architecture::Mixtral { 1e6 } else { 10000.0 };
    Ok(ModelConfig {
        architecture,
        vocab_size,
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        intermediate_size,
        rms_norm_eps: fields.optional_f64("rms_norm_eps")?.unwrap_or(default_eps),
        rope: read_rope(fields, default_theta)?,
        tie_word_embeddings: fields.optional_bool("tie_word_embeddings")?.unwrap_or(false),
        dtype: read_dtype(fields)?,
        attention_bias,
        max_position_embeddings: fields.optional_u64("max_position_embeddings")?.unwrap_or(default_max_positions),
        sliding_window: read_sliding_window(fields, architecture, num_layers)?,
        moe: read_moe(fields, architecture, intermediate_size)?,
        name: read_name(fields)?,
    })
}

/// `architectures[0]`, or `model_type` when the file has no `architectures`.
fn read_architecture(fields: &Fields<'_>) -> Result<Architecture> {
    let (field, name) = match fields.get("architectures") {
        Some(Value::Array(names)) => match names.first() {
            Some(Value::String(name)) => ("architectures", name.as_str()),
            Some(other) => {
                return Err(fields.bad_field("architectures[0]", "a class name string", other));
            }
            None => {
                return Err(fields.bad_field(
                    "architectures",
                    "a non-empty array of class names",
                    &Value::Array(vec![]),
                ))
            }
        },
        Some(other) => return Err(fields.bad_field("architectures", "an array of class names", other)),
        None => match fields.optional_str("model_type")? {
            Some(model_type) => ("model_type", model_type),
            None => return Err(fields.missing("architectures")),
        },
    };
    Architecture::from_hf_name(name).ok_or_else(|| ConfigError::UnknownArchitecture {
        file: fields.file.to_owned(),
        field: field.to_owned(),
        architecture: name.to_owned(),
        supported: Architecture::CLASS_NAMES,
    })
}

/// transformers treats an absent `num_key_value_heads` (the class default: Llama none, Mistral 8,
/// Qwen2 32) differently from an explicit `null` (always `num_attention_heads`).
fn read_num_kv_heads(fields: &Fields<'_>, architecture: Architecture, num_heads: u64) -> Result<u64> {
    if fields.object.contains_key("num_key_value_heads") {
        return Ok(fields.optional_u64("num_key_value_heads")?.unwrap_or(num_heads));
    }
    Ok(match architecture {
        Architecture::Llama => num_heads,
        Architecture::Mistral | Architecture::Mixtral => 8,
        Architecture::Qwen2 => 32,
        Architecture::Qwen2Moe => 16,
    })
}

/// Qwen2 always has q/k/v biases and Mistral never has any, whatever the file says. Llama's
/// `attention_bias` also puts a bias on the o projection, which [`ModelConfig`] cannot express.
fn read_attention_bias(fields: &Fields<'_>, architecture: Architecture) -> Result<bool> {
    match architecture {
        Architecture::Qwen2 | Architecture::Qwen2Moe => return Ok(true),
        Architecture::Mistral | Architecture::Mixtral => return Ok(false),
        Architecture::Llama => {}
    }
    if fields.optional_bool("attention_bias")? == Some(true) {
        return Err(fields.unsupported(
            "attention_bias",
            "true",
            "Llama's attention_bias also adds an o_proj bias, which pleat does not build; use false",
        ));
    }
    if fields.optional_bool("mlp_bias")? == Some(true) {
        return Err(fields.unsupported("mlp_bias", "true", "pleat builds MLPs without biases; use false"));
    }
    Ok(false)
}

/// `dtype` (transformers 5) or `torch_dtype` (transformers 4); float32 when neither is present.
fn read_dtype(fields: &Fields<'_>) -> Result<ConfigDtype> {
    let key = if fields.get("dtype").is_some() { "dtype" } else { "torch_dtype" };
    match fields.optional_str(key)? {
        None => Ok(ConfigDtype::F32),
        Some(name) => ConfigDtype::from_hf_name(name).ok_or_else(|| {
            fields.unsupported(key, &format!("\"{name}\""), "pleat reads float32, bfloat16 and float16 checkpoints")
        }),
    }
}

/// Mistral's window defaults to 4096 when absent. Qwen2's counts only with `use_sliding_window`, and
/// then only for the layers from `max_window_layers` (default 28) on, a mix pleat does not build. Llama
/// has none.
fn read_sliding_window(fields: &Fields<'_>, architecture: Architecture, num_layers: u64) -> Result<Option<u64>> {
    match architecture {
        Architecture::Llama => Ok(None),
        Architecture::Mistral => match fields.object.contains_key("sliding_window") {
            true => fields.optional_u64("sliding_window"),
            false => Ok(Some(4096)),
        },
        Architecture::Mixtral => fields.optional_u64("sliding_window"),
        Architecture::Qwen2 | Architecture::Qwen2Moe => {
            let enabled = fields.optional_bool("use_sliding_window")? == Some(true);
            let full_layers = fields.optional_u64("max_window_layers")?.unwrap_or(28);
            if enabled && full_layers < num_layers {
                return Err(fields.unsupported(
                    "use_sliding_window",
                    "true",
                    "Qwen2's sliding window on the layers from max_window_layers on is not built by pleat; \
                     use false, or max_window_layers >= num_hidden_layers",
                ));
            }
            // transformers 5 windows the layers `layer_types` marks, whatever max_window_layers
            // says.
            let sliding = fields
                .get("layer_types")
                .and_then(Value::as_array)
                .is_some_and(|types| types.iter().any(|layer_type| layer_type.as_str() == Some("sliding_attention")));
            if enabled && sliding {
                return Err(fields.unsupported(
                    "layer_types",
                    "[.., \"sliding_attention\", ..]",
                    "Qwen2's sliding window on the layers layer_types marks is not built by pleat; use \
                     use_sliding_window false, or only \"full_attention\" layers",
                ));
            }
            Ok(None)
        }
    }
}

/// The routed experts of Mixtral and Qwen2-MoE with transformers' class defaults; `None` for the dense
/// families. Qwen2-MoE layers that keep a dense MLP (`decoder_sparse_step` > 1, `mlp_only_layers`) and
/// Mixtral's router jitter are refused.
fn read_moe(fields: &Fields<'_>, architecture: Architecture, intermediate_size: u64) -> Result<Option<MoeConfig>> {
    match architecture {
        Architecture::Llama | Architecture::Mistral | Architecture::Qwen2 => Ok(None),
        Architecture::Mixtral => {
            if let Some(jitter) = fields.optional_f64("router_jitter_noise")? {
                if jitter != 0.0 {
                    return Err(fields.unsupported(
                        "router_jitter_noise",
                        &jitter.to_string(),
                        "pleat routes deterministically; use 0.0",
                    ));
                }
            }
            Ok(Some(MoeConfig {
                num_experts: fields.optional_u64("num_local_experts")?.unwrap_or(8),
                top_k: fields.optional_u64("num_experts_per_tok")?.unwrap_or(2),
                expert_intermediate_size: intermediate_size,
                normalize_top_k: true,
                shared_expert_intermediate_size: None,
                router_aux_loss_coef: fields.optional_f64("router_aux_loss_coef")?.unwrap_or(0.001),
                output_router_logits: fields.optional_bool("output_router_logits")?.unwrap_or(false),
            }))
        }
        Architecture::Qwen2Moe => {
            let step = fields.optional_u64("decoder_sparse_step")?.unwrap_or(1);
            if step != 1 {
                return Err(fields.unsupported(
                    "decoder_sparse_step",
                    &step.to_string(),
                    "pleat builds routed experts in every layer; use 1",
                ));
            }
            match fields.get("mlp_only_layers") {
                None => {}
                Some(serde_json::Value::Array(layers)) if layers.is_empty() => {}
                Some(other) => {
                    return Err(fields.unsupported(
                        "mlp_only_layers",
                        &abbreviate(other),
                        "pleat builds routed experts in every layer; use []",
                    ))
                }
            }
            Ok(Some(MoeConfig {
                num_experts: fields.optional_u64("num_experts")?.unwrap_or(60),
                top_k: fields.optional_u64("num_experts_per_tok")?.unwrap_or(4),
                expert_intermediate_size: fields.optional_u64("moe_intermediate_size")?.unwrap_or(1408),
                normalize_top_k: fields.optional_bool("norm_topk_prob")?.unwrap_or(false),
                // A width of 0 is no shared expert: transformers builds one of no channels, which adds
                // nothing (and `ModelConfig::to_hf_json` writes 0 for a mixture without one).
                shared_expert_intermediate_size: Some(
                    fields.optional_u64("shared_expert_intermediate_size")?.unwrap_or(5632),
                )
                .filter(|&width| width > 0),
                router_aux_loss_coef: fields.optional_f64("router_aux_loss_coef")?.unwrap_or(0.001),
                output_router_logits: fields.optional_bool("output_router_logits")?.unwrap_or(false),
            }))
        }
    }
}

/// The RoPE settings from `rope_parameters` (transformers 5), else `rope_scaling` (transformers 4).
/// `rope_theta` is looked up in `rope_parameters` first, then at the top level, then defaults to
/// `default_theta` (the config class's).
fn read_rope(fields: &Fields<'_>, default_theta: f64) -> Result<RopeConfig> {
    let parameters = fields.optional_object("rope_parameters")?;
    let theta_in_parameters = match &parameters {
        Some(parameters) => parameters.optional_f64("rope_theta")?.map(|theta| (parameters.path("rope_theta"), theta)),
        None => None,
    };
    let theta_at_top = fields.optional_f64("rope_theta")?.map(|theta| (fields.path("rope_theta"), theta));
    let (theta_field, theta) = theta_in_parameters.or(theta_at_top).unwrap_or(("rope_theta".to_owned(), default_theta));
    if !(theta.is_finite() && theta > 0.0) {
        return Err(bad_value(fields.file, &theta_field, &theta.to_string(), "a finite number > 0"));
    }
    reject_partial_rotary(fields)?;
    let section = match parameters {
        Some(parameters) => Some(parameters),
        None => fields.optional_object("rope_scaling")?,
    };
    let Some(section) = section else {
        return Ok(RopeConfig { theta, scaling: RopeScaling::None });
    };
    reject_partial_rotary(&section)?;
    if let Some((key, _)) = section.object.iter().find(|(_, value)| value.is_object()) {
        return Err(section.unsupported(
            key,
            "{...}",
            "per-layer-type rope parameters are not built by pleat; give one flat set of rope parameters",
        ));
    }
    // transformers 4 first spelled `rope_type` as `type`.
    let type_key = if section.get("rope_type").is_some() { "rope_type" } else { "type" };
    let scaling = match section.optional_str(type_key)?.unwrap_or("default") {
        "default" => RopeScaling::None,
        "llama3" => read_llama3_scaling(&section)?,
        other => {
            return Err(ConfigError::UnsupportedRopeType {
                file: fields.file.to_owned(),
                field: section.path(type_key),
                rope_type: other.to_owned(),
                supported: RopeScaling::SUPPORTED_TYPES,
            })
        }
    };
    Ok(RopeConfig { theta, scaling })
}

/// The four numbers of `rope_type` `llama3`, checked so that the frequencies come out finite.
fn read_llama3_scaling(section: &Fields<'_>) -> Result<RopeScaling> {
    let factor = section.required_f64("factor")?;
    let low_freq_factor = section.required_f64("low_freq_factor")?;
    let high_freq_factor = section.required_f64("high_freq_factor")?;
    let original_max_position_embeddings = section.required_u64("original_max_position_embeddings")?;
    for (key, number) in [("factor", factor), ("low_freq_factor", low_freq_factor)] {
        if !(number.is_finite() && number > 0.0) {
            return Err(bad_value(section.file, &section.path(key), &number.to_string(), "a finite number > 0"));
        }
    }
    // The smooth interpolation divides by `high_freq_factor - low_freq_factor`.
    if !(high_freq_factor.is_finite() && high_freq_factor > low_freq_factor) {
        let value = high_freq_factor.to_string();
        let field = section.path("high_freq_factor");
        return Err(bad_value(section.file, &field, &value, "finite and greater than low_freq_factor"));
    }
    if original_max_position_embeddings == 0 {
        let field = section.path("original_max_position_embeddings");
        return Err(bad_value(section.file, &field, "0", "at least 1"));
    }
    Ok(RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings })
}

/// transformers rotates only part of each head when `partial_rotary_factor` < 1; pleat rotates all of it.
fn reject_partial_rotary(fields: &Fields<'_>) -> Result<()> {
    match fields.optional_f64("partial_rotary_factor")? {
        Some(factor) if factor != 1.0 => Err(fields.unsupported(
            "partial_rotary_factor",
            &factor.to_string(),
            "pleat applies rotary embeddings to whole heads; use 1.0",
        )),
        _ => Ok(()),
    }
}

/// `_name_or_path` when non-empty; otherwise the directory of a `.../NAME/config.json`, or the file stem.
fn read_name(fields: &Fields<'_>) -> Result<String> {
    if let Some(name) = fields.optional_str("_name_or_path")? {
        if !name.is_empty() {
            return Ok(name.to_owned());
        }
    }
    let mut parts = fields.file.rsplit(['/', '\\']).filter(|part| !part.is_empty());
    let file_name = parts.next().unwrap_or(fields.file);
    let name = match file_name {
        "config.json" => parts.next().unwrap_or(file_name),
        _ => file_name.strip_suffix(".json").unwrap_or(file_name),
    };
    Ok(name.to_owned())
}

/// One JSON object being read, with the path prefix that error messages put before its keys.
struct Fields<'a> {
    file: &'a str,
    object: &'a Map<String, Value>,
    prefix: String,
}

impl<'a> Fields<'a> {
    /// The value of `key`; `null` counts as absent, as transformers treats it for optional fields.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.object.get(key).filter(|value| !value.is_null())
    }

    fn path(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    fn missing(&self, key: &str) -> ConfigError {
        ConfigError::MissingField { file: self.file.to_owned(), field: self.path(key) }
    }

    fn bad_field(&self, key: &str, expected: &'static str, found: &Value) -> ConfigError {
        ConfigError::BadField { file: self.file.to_owned(), field: self.path(key), expected, found: abbreviate(found) }
    }

    fn unsupported(&self, key: &str, value: &str, reason: &'static str) -> ConfigError {
        ConfigError::Unsupported { file: self.file.to_owned(), field: self.path(key), value: value.to_owned(), reason }
    }

    fn required_u64(&self, key: &str) -> Result<u64> {
        match self.object.get(key) {
            None => Err(self.missing(key)),
            Some(value) => value.as_u64().ok_or_else(|| self.bad_field(key, "a non-negative integer", value)),
        }
    }

    fn optional_u64(&self, key: &str) -> Result<Option<u64>> {
        self.get(key)
            .map(|value| value.as_u64().ok_or_else(|| self.bad_field(key, "a non-negative integer", value)))
            .transpose()
    }

    fn required_f64(&self, key: &str) -> Result<f64> {
        match self.object.get(key) {
            None => Err(self.missing(key)),
            Some(value) => value.as_f64().ok_or_else(|| self.bad_field(key, "a number", value)),
        }
    }

    fn optional_f64(&self, key: &str) -> Result<Option<f64>> {
        self.get(key).map(|value| value.as_f64().ok_or_else(|| self.bad_field(key, "a number", value))).transpose()
    }

    fn optional_bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|value| value.as_bool().ok_or_else(|| self.bad_field(key, "true or false", value)))
            .transpose()
    }

    fn optional_str(&self, key: &str) -> Result<Option<&'a str>> {
        self.get(key).map(|value| value.as_str().ok_or_else(|| self.bad_field(key, "a string", value))).transpose()
    }

    /// The object under `key`, whose fields are then named `key.field` in errors.
    fn optional_object(&self, key: &str) -> Result<Option<Fields<'a>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(object)) => {
                Ok(Some(Fields { file: self.file, object, prefix: format!("{}.", self.path(key)) }))
            }
            Some(other) => Err(self.bad_field(key, "an object or null", other)),
        }
    }
}

/// serde_json's message ends with " at line L column C"; the position moves into the error's fields.
fn malformed(file: &str, error: &serde_json::Error) -> ConfigError {
    let (line, column) = (error.line(), error.column());
    let full = error.to_string();
    let suffix = format!(" at line {line} column {column}");
    let message = full.strip_suffix(&suffix).unwrap_or(&full).to_owned();
    ConfigError::MalformedJson { file: file.to_owned(), line, column, message }
}

/// A value as compact JSON, cut to a length that keeps messages on one line.
fn abbreviate(value: &Value) -> String {
    const LIMIT: usize = 40;
    let text = value.to_string();
    match text.char_indices().nth(LIMIT) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text,
    }
}
