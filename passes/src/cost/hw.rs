//! Hardware specs: device memory, peak FLOP/s, HBM bandwidth, and the two link classes.
//!
//! The built-in table ([`HardwareSpec::builtin`]) holds vendor figures, each cited beside it. Peak
//! FLOP/s are dense (no 2:4 sparsity). Link bandwidths are a direction, per GPU: what one rank can
//! send while it also receives, which is the `β` of the alpha-beta model. Latencies are the `α` of
//! one hop, of the order nccl-tests and rccl-tests show for small messages; they matter only for
//! small collectives. A TOML or JSON file with the same fields replaces or extends the table
//! ([`HardwareSpec::from_toml_str`], [`HardwareSpec::from_json_str`]); unknown fields are errors.

use serde::{Deserialize, Serialize};

use super::{CostError, Result};

/// One class of links: bandwidth a direction and per-hop latency.
#[derive(Copy, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkSpec {
    /// Bytes a second one rank sends on this class (one direction).
    pub bandwidth_bytes_per_s: f64,
    /// Seconds of one hop's fixed cost.
    pub latency_s: f64,
}

/// The fraction of peak each op class reaches (a roofline's efficiency factors).
#[derive(Copy, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Efficiency {
    /// Large GEMMs, of peak FLOP/s.
    pub matmul: f64,
    /// Flash attention, of peak FLOP/s.
    pub attention: f64,
    /// Memory-bound ops (norms, rope, activations, adds), of HBM bandwidth.
    pub memory_bound: f64,
    /// Collectives, of link bandwidth.
    pub link: f64,
}

impl Default for Efficiency {
    /// Typical fractions measured by large trainings: Megatron reaches about 70-80 % of peak on
    /// large GEMMs (Narayanan et al. 2021, section 5.1 reports up to 52 % MFU end to end), flash
    /// attention 2 about 50-70 % (Dao 2023, section 4.1), streaming kernels about 80 % of HBM, and
    /// NCCL's ring bus bandwidth about 80 % of the link's (nccl-tests on DGX H100).
    fn default() -> Self {
        Efficiency { matmul: 0.75, attention: 0.6, memory_bound: 0.8, link: 0.8 }
    }
}

/// A device type and its interconnect.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HardwareSpec {
    /// The name (`h100-sxm`, `mi300x`, ...).
    pub name: String,
    /// Device memory in bytes, as the vendor's tools report it.
    pub memory_bytes: u64,
    /// Dense bf16 peak, FLOP/s (tensor cores / matrix cores).
    pub peak_bf16_flops: f64,
    /// Dense f32 peak, FLOP/s (vector units, no TF32).
    pub peak_f32_flops: f64,
    /// HBM bandwidth, bytes a second.
    pub hbm_bytes_per_s: f64,
    /// Links between GPUs of one node (NVLink, Infinity Fabric).
    pub intra_node: LinkSpec,
    /// Links between nodes (InfiniBand, RoCE), per GPU.
    pub inter_node: LinkSpec,
    /// GPUs a node.
    pub gpus_per_node: u64,
    /// Efficiency factors; the defaults when a file leaves them out.
    #[serde(default)]
    pub efficiency: Efficiency,
}

const MIB: u64 = 1 << 20;
const GB: f64 = 1e9;
const TB: f64 = 1e12;
const TFLOPS: f64 = 1e12;

/// The names of the built-in specs, in the order messages list them.
pub const BUILTIN_NAMES: [&str; 5] = ["h100-sxm", "h200", "a100-80gb", "mi300x", "cpu"];

impl HardwareSpec {
    /// The built-in spec called `name` (case-insensitive; `h100` and `a100` are accepted too).
    pub fn builtin(name: &str) -> Result<HardwareSpec> {
        let lower = name.to_ascii_lowercase();
        let spec = match lower.as_str() {
            "h100-sxm" | "h100" => h100_sxm(),
            "h200" => h200(),
            "a100-80gb" | "a100" => a100_80gb(),
            "mi300x" => mi300x(),
            "cpu" => cpu(),
            _ => return Err(CostError::UnknownHardware { name: name.to_string(), known: BUILTIN_NAMES.to_vec() }),
        };
        Ok(spec)
    }

    /// Reads a spec from TOML text; `file` names it in errors.
    pub fn from_toml_str(text: &str, file: &str) -> Result<HardwareSpec> {
        let spec: HardwareSpec = toml::from_str(text)
            .map_err(|err| CostError::HardwareFile { file: file.to_string(), reason: err.to_string() })?;
        spec.validate()
    }

    /// Reads a spec from JSON text; `file` names it in errors.
    pub fn from_json_str(text: &str, file: &str) -> Result<HardwareSpec> {
        let spec: HardwareSpec = serde_json::from_str(text)
            .map_err(|err| CostError::HardwareFile { file: file.to_string(), reason: err.to_string() })?;
        spec.validate()
    }

    /// Rejects zero or negative figures, which would make every time infinite, and efficiencies
    /// above 1, which would have a device beat its own peak.
    pub fn validate(self) -> Result<HardwareSpec> {
        let positive = [
            ("memory_bytes", self.memory_bytes as f64),
            ("peak_bf16_flops", self.peak_bf16_flops),
            ("peak_f32_flops", self.peak_f32_flops),
            ("hbm_bytes_per_s", self.hbm_bytes_per_s),
            ("intra_node.bandwidth_bytes_per_s", self.intra_node.bandwidth_bytes_per_s),
            ("inter_node.bandwidth_bytes_per_s", self.inter_node.bandwidth_bytes_per_s),
            ("gpus_per_node", self.gpus_per_node as f64),
        ];
        let shares = [
            ("efficiency.matmul", self.efficiency.matmul),
            ("efficiency.attention", self.efficiency.attention),
            ("efficiency.memory_bound", self.efficiency.memory_bound),
            ("efficiency.link", self.efficiency.link),
        ];
        let latencies =
            [("intra_node.latency_s", self.intra_node.latency_s), ("inter_node.latency_s", self.inter_node.latency_s)];
        let checks = positive
            .into_iter()
            .map(|(field, value)| (field, value, value > 0.0, "positive"))
            .chain(shares.into_iter().map(|(field, value)| (field, value, value > 0.0 && value <= 1.0, "in (0, 1]")))
            .chain(latencies.into_iter().map(|(field, value)| (field, value, value >= 0.0, "zero or positive")));
        for (field, value, within, must) in checks {
            if !(value.is_finite() && within) {
                return Err(CostError::HardwareValue { name: self.name.clone(), field, value, must });
            }
        }
        Ok(self)
    }

    /// The peak FLOP/s for elements of `dtype_bytes` bytes (bf16/f16 tensor cores, or f32).
    pub fn peak_flops(&self, dtype_bytes: u64) -> f64 {
        if dtype_bytes >= 4 {
            self.peak_f32_flops
        } else {
            self.peak_bf16_flops
        }
    }
}

/// NVIDIA H100 SXM5 80 GB. Memory: 81,559 MiB as nvidia-smi reports. Compute and HBM: the H100
/// datasheet (989.4 TFLOP/s dense BF16 tensor core, 66.9 TFLOP/s FP32, 3.35 TB/s HBM3). NVLink 4:
/// 900 GB/s total, so 450 GB/s a direction. Inter-node: one ConnectX-7 NDR 400 Gb/s NIC a GPU on
/// DGX H100, 50 GB/s a direction.
fn h100_sxm() -> HardwareSpec {
    HardwareSpec {
        name: "h100-sxm".into(),
        memory_bytes: 81_559 * MIB,
        peak_bf16_flops: 989.4 * TFLOPS,
        peak_f32_flops: 66.9 * TFLOPS,
        hbm_bytes_per_s: 3.35 * TB,
        intra_node: LinkSpec { bandwidth_bytes_per_s: 450.0 * GB, latency_s: 3e-6 },
        inter_node: LinkSpec { bandwidth_bytes_per_s: 50.0 * GB, latency_s: 6e-6 },
        gpus_per_node: 8,
        efficiency: Efficiency::default(),
    }
}

/// NVIDIA H200 SXM 141 GB: the H100's compute and NVLink (H200 datasheet: 989 TFLOP/s dense BF16,
/// 67 TFLOP/s FP32, 900 GB/s NVLink) with 141 GB HBM3e at 4.8 TB/s; 143,771 MiB as nvidia-smi
/// reports. Inter-node as DGX H200: NDR 400 Gb/s a GPU.
fn h200() -> HardwareSpec {
    HardwareSpec { name: "h200".into(), memory_bytes: 143_771 * MIB, hbm_bytes_per_s: 4.8 * TB, ..h100_sxm() }
}

/// NVIDIA A100 SXM4 80 GB. A100 datasheet: 312 TFLOP/s dense BF16, 19.5 TFLOP/s FP32, 2,039 GB/s
/// HBM2e, NVLink 3 600 GB/s total (300 a direction); 81,920 MiB as nvidia-smi reports. Inter-node
/// as DGX A100: one HDR 200 Gb/s NIC a GPU, 25 GB/s a direction.
fn a100_80gb() -> HardwareSpec {
    HardwareSpec {
        name: "a100-80gb".into(),
        memory_bytes: 81_920 * MIB,
        peak_bf16_flops: 312.0 * TFLOPS,
        peak_f32_flops: 19.5 * TFLOPS,
        hbm_bytes_per_s: 2.039 * TB,
        intra_node: LinkSpec { bandwidth_bytes_per_s: 300.0 * GB, latency_s: 4e-6 },
        inter_node: LinkSpec { bandwidth_bytes_per_s: 25.0 * GB, latency_s: 7e-6 },
        gpus_per_node: 8,
        efficiency: Efficiency::default(),
    }
}

/// AMD Instinct MI300X. AMD's datasheet: 192 GB HBM3 at 5.3 TB/s, 1,307.4 TFLOP/s dense BF16,
/// 163.4 TFLOP/s FP32 vector; rocm-smi reports 205,822,885,888 bytes of VRAM. Infinity Fabric: each
/// GPU links to its 7 peers at 64 GB/s a direction (896 GB/s bidirectional aggregate on the
/// datasheet), 448 GB/s a direction in all. Inter-node: one 400 Gb/s NIC a GPU, 50 GB/s.
fn mi300x() -> HardwareSpec {
    HardwareSpec {
        name: "mi300x".into(),
        memory_bytes: 205_822_885_888,
        peak_bf16_flops: 1307.4 * TFLOPS,
        peak_f32_flops: 163.4 * TFLOPS,
        hbm_bytes_per_s: 5.3 * TB,
        intra_node: LinkSpec { bandwidth_bytes_per_s: 448.0 * GB, latency_s: 4e-6 },
        inter_node: LinkSpec { bandwidth_bytes_per_s: 50.0 * GB, latency_s: 7e-6 },
        gpus_per_node: 8,
        efficiency: Efficiency::default(),
    }
}

/// This build's CPU runtime with ranks as threads, nominal until a calibration command measures
/// it. Figures of the 2-core x86-64 VMs pleat is developed on, which report AVX2 and FMA but not
/// AVX-512: 2 cores x 2 FMA units x 8 f32 lanes x 2 FLOP x 3 GHz = 192 GFLOP/s f32 peak (the
/// runtime computes bf16 in f32, so the same; gemm's AVX-512 kernels would double it where the CPU
/// has them), about 20 GB/s of DRAM bandwidth, 16 GiB; "links" are shared-memory copies between
/// threads at about 5 GB/s with microseconds of channel latency.
fn cpu() -> HardwareSpec {
    HardwareSpec {
        name: "cpu".into(),
        memory_bytes: 16 << 30,
        peak_bf16_flops: 192e9,
        peak_f32_flops: 192e9,
        hbm_bytes_per_s: 20.0 * GB,
        intra_node: LinkSpec { bandwidth_bytes_per_s: 5.0 * GB, latency_s: 5e-6 },
        inter_node: LinkSpec { bandwidth_bytes_per_s: 5.0 * GB, latency_s: 5e-6 },
        gpus_per_node: 1024,
        efficiency: Efficiency::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtins_are_valid_and_named() {
        for name in BUILTIN_NAMES {
            let spec = HardwareSpec::builtin(name).unwrap();
            assert_eq!(spec.name, name);
            assert_eq!(spec.clone().validate().unwrap(), spec);
        }
        assert_eq!(HardwareSpec::builtin("H100").unwrap().name, "h100-sxm");
    }

    #[test]
    fn design_figures() {
        // DESIGN.md section 5: H100 989 TFLOP/s, 3.35 TB/s, NVLink 450 GB/s, IB 50 GB/s; H200 4.8 TB/s;
        // MI300X 1307 TFLOP/s and 5.3 TB/s.
        let h100 = HardwareSpec::builtin("h100-sxm").unwrap();
        assert_eq!(
            (h100.peak_bf16_flops, h100.hbm_bytes_per_s, h100.intra_node.bandwidth_bytes_per_s),
            (989.4e12, 3.35e12, 450e9)
        );
        assert_eq!(h100.inter_node.bandwidth_bytes_per_s, 50e9);
        assert_eq!(HardwareSpec::builtin("h200").unwrap().hbm_bytes_per_s, 4.8e12);
        let mi300x = HardwareSpec::builtin("mi300x").unwrap();
        assert_eq!((mi300x.peak_bf16_flops, mi300x.hbm_bytes_per_s), (1307.4e12, 5.3e12));
        assert!(mi300x.memory_bytes > 192_000_000_000);
    }

    #[test]
    fn unknown_hardware_lists_the_table() {
        assert_eq!(
            HardwareSpec::builtin("tpu-v5").unwrap_err().to_string(),
            "unknown hardware `tpu-v5`; use one of h100-sxm, h200, a100-80gb, mi300x, cpu or --hw-file"
        );
    }

    #[test]
    fn toml_and_json_files_round_trip() {
        let spec = HardwareSpec::builtin("mi300x").unwrap();
        let toml_text = toml::to_string(&spec).unwrap();
        assert_eq!(HardwareSpec::from_toml_str(&toml_text, "mi.toml").unwrap(), spec);
        let json_text = serde_json::to_string(&spec).unwrap();
        assert_eq!(HardwareSpec::from_json_str(&json_text, "mi.json").unwrap(), spec);
    }

    #[test]
    fn a_file_without_efficiency_takes_the_defaults() {
        let text = r#"
            name = "lab-gpu"
            memory_bytes = 1000
            peak_bf16_flops = 1e12
            peak_f32_flops = 1e11
            hbm_bytes_per_s = 1e11
            gpus_per_node = 4
            intra_node = { bandwidth_bytes_per_s = 1e10, latency_s = 1e-6 }
            inter_node = { bandwidth_bytes_per_s = 1e9, latency_s = 1e-5 }
        "#;
        let spec = HardwareSpec::from_toml_str(text, "lab.toml").unwrap();
        assert_eq!(spec.efficiency, Efficiency::default());
        assert_eq!(spec.gpus_per_node, 4);
    }

    #[test]
    fn bad_files_are_named_errors() {
        let error = HardwareSpec::from_toml_str("name = 3", "x.toml").unwrap_err();
        assert!(error.to_string().starts_with("x.toml: "), "{error}");
        let mut spec = HardwareSpec::builtin("cpu").unwrap();
        spec.hbm_bytes_per_s = 0.0;
        let text = serde_json::to_string(&spec).unwrap();
        assert_eq!(
            HardwareSpec::from_json_str(&text, "cpu.json").unwrap_err().to_string(),
            "hardware cpu: hbm_bytes_per_s = 0 must be positive"
        );
        let mut fast = HardwareSpec::builtin("cpu").unwrap();
        fast.efficiency.matmul = 1.5;
        assert_eq!(fast.validate().unwrap_err().to_string(), "hardware cpu: efficiency.matmul = 1.5 must be in (0, 1]");
        let mut early = HardwareSpec::builtin("cpu").unwrap();
        early.inter_node.latency_s = -1e-6;
        assert_eq!(
            early.validate().unwrap_err().to_string(),
            "hardware cpu: inter_node.latency_s = -0.000001 must be zero or positive"
        );
        let typo = serde_json::to_string(&spec).unwrap().replace("gpus_per_node", "gpus_a_node");
        assert!(HardwareSpec::from_json_str(&typo, "t.json").unwrap_err().to_string().contains("gpus_a_node"));
    }
}
