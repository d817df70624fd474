//! Pipelines: several models in one process per GPU (RLHF, DPO, reward scoring). A pipeline
//! lists its instances (each a run spec, built in order) and the phases of one iteration:
//! which instances run which pass, and which are moved to the host meanwhile.
//!
//! ```yaml
//! instances:
//!   - {name: actor, model: qwen2.5-1.5b, precision: amp-bf16, optimizer: adamw, batch_size: 4, seq_len: 1024}
//!   - {name: ref, model: qwen2.5-1.5b, precision: bf16, mode: forward, batch_size: 4, seq_len: 1024, home: cpu}
//!   - {name: scorer, shares: actor}         # the same model object under a second name
//! phases:
//!   - {name: ref_logprob, run: [ref], offload: [actor]}
//!   - {name: score, run: [{instance: scorer, pass: forward, repeat: 2}]}
//!   - {name: train, run: [actor]}
//! iterations: 3
//! ```
//!
//! `home: cpu` builds an instance on the host: a phase that runs it copies it in
//! (`model.cuda()`) and out again. `offload` moves instances out for the phase and back after
//! it (`model.cpu()`: parameters only, optimizer states stay). A `parallel` section in an
//! instance shards it over ranks; the estimate is then per rank. The two-model form
//! `{policy, reference, placement, iterations}` (placement `resident`, `manual-offload` or
//! `fsdp2-offload`) is read as the two-instance pipeline it describes.

use serde_json::{Map, Value};

use super::parse::unknown_key;
use super::run::{
    Fsdp1Options, FsdpUnits, Mode, Optimizer, Parallel, RunSpec, Strategy, TensorParallel,
};
use super::versions::Versions;
use crate::error::{Error, Result};
use crate::limits;

/// Where an instance's parameters are built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Home {
    /// `from_config` on the GPU (or FSDP2's shards there).
    Gpu,
    /// On the host: nothing on the GPU until it is moved there.
    Cpu,
}

/// What a phase runs on an instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// forward, backward, `optimizer.step()`, `zero_grad()`.
    Train,
    /// The no-grad log-prob pass (a reference, a reward model, a scoring pass).
    Forward,
    /// `model.generate` of `new_tokens` tokens after a prompt of the rest of `seq_len`.
    Generate { new_tokens: u64 },
}

/// A pass of one phase: which instance (by index), what it runs, how often.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PassDef {
    pub instance: usize,
    pub pass: Pass,
    pub repeat: u32,
}

/// A phase of an iteration: its passes, and the instances moved out of the way meanwhile.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PhaseDef {
    pub name: String,
    pub passes: Vec<PassDef>,
    /// Instances whose parameters move to the host for the phase (and back after it).
    pub offload: Vec<usize>,
    /// Training instances whose optimizer states move to the host for the phase (verl's
    /// `optimizer_offload`, slime's `move_torch_optimizer`).
    pub offload_optimizer: Vec<usize>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct InstanceSpec {
    pub name: String,
    /// Where the instance is written (`instances[0]`, `policy`): errors about it name fields
    /// under it.
    pub at: String,
    pub spec: RunSpec,
    pub home: Home,
    /// Other names of this instance (`shares:`), reported with it.
    pub aliases: Vec<String>,
    /// A rollout engine (`engine: vllm`) rather than a model in PyTorch's allocator.
    pub engine: Option<EngineSpec>,
}

/// A vLLM-style rollout engine colocated with the trainer (verl, OpenRLHF, slime): awake, it
/// holds `gpu_memory_utilization` of the device (weights, KV cache, its activations) in its own
/// memory pool, outside PyTorch's caching allocator; asleep, level 1 keeps its weights in host
/// memory and drops the KV cache, level 2 drops both.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineSpec {
    pub gpu_memory_utilization: f64,
    /// `None`: never sleeps (awake from start to end).
    pub sleep_level: Option<u8>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct PipelineSpec {
    pub instances: Vec<InstanceSpec>,
    pub phases: Vec<PhaseDef>,
    pub iterations: u32,
    /// The process's library versions (`versions:`); an instance's own take precedence.
    pub versions: Versions,
}

/// Whether a parsed document is a pipeline rather than a run spec.
pub fn is_pipeline(doc: &Value) -> bool {
    doc.get("instances").is_some() || doc.get("policy").is_some()
}

fn iterations(obj: &Map<String, Value>) -> Result<u32> {
    match obj.get("iterations") {
        None => Ok(3),
        Some(v) => v
            .as_u64()
            .filter(|&n| (1..=100).contains(&n))
            .map(|n| n as u32)
            .ok_or_else(|| Error::field("iterations", v, "use an integer from 1 to 100")),
    }
}

impl PipelineSpec {
    pub fn from_value(value: &Value) -> Result<Self> {
        let empty = Map::new();
        let obj = value.as_object().unwrap_or(&empty);
        if obj.contains_key("policy") {
            return Self::from_policy_reference(obj);
        }
        unknown_key(
            obj,
            "",
            &["instances", "phases", "iterations", "versions"],
            "a pipeline key",
        )?;
        let list = |key: &str, what: &str| -> Result<&Vec<Value>> {
            obj.get(key)
                .and_then(Value::as_array)
                .filter(|a| !a.is_empty())
                .ok_or_else(|| {
                    Error::field(
                        key,
                        obj.get(key).cloned().unwrap_or(Value::Null),
                        format!("a non-empty list of {what}"),
                    )
                })
        };
        let mut instances: Vec<InstanceSpec> = Vec::new();
        for (i, item) in at_most(
            list("instances", "instances {name, model, ...}")?,
            "instances",
            limits::MAX_INSTANCES,
        )?
        .iter()
        .enumerate()
        {
            let at = format!("instances[{i}]");
            let mut fields = item
                .as_object()
                .cloned()
                .ok_or_else(|| Error::field(&at, item, "a mapping {name, model, ...}"))?;
            let name = match fields.remove("name") {
                Some(Value::String(n)) if !n.is_empty() => n,
                other => {
                    return Err(Error::field(
                        format!("{at}.name"),
                        other.unwrap_or(Value::Null),
                        "a name for the instance",
                    ));
                }
            };
            if instances
                .iter()
                .any(|x| x.name == name || x.aliases.contains(&name))
            {
                return Err(Error::field(
                    format!("{at}.name"),
                    name,
                    "instance names must be different",
                ));
            }
            if let Some(target) = fields.remove("shares") {
                unknown_key(
                    &fields,
                    &format!("{at}."),
                    &["name", "shares"],
                    "a key of an instance that shares another",
                )?;
                let target = target.as_str().unwrap_or_default();
                let Some(owner) = instances.iter_mut().find(|x| x.name == target) else {
                    return Err(Error::field(
                        format!("{at}.shares"),
                        target,
                        "the name of an instance listed before it",
                    ));
                };
                owner.aliases.push(name);
                continue;
            }
            let engine = match fields.remove("engine") {
                None => None,
                Some(Value::String(e)) if e == "vllm" => {
                    let util = match fields.remove("gpu_memory_utilization") {
                        None => 0.9,
                        Some(v) => {
                            v.as_f64()
                                .filter(|u| *u > 0.0 && *u <= 1.0)
                                .ok_or_else(|| {
                                    Error::field(
                                        format!("{at}.gpu_memory_utilization"),
                                        v,
                                        "a fraction in (0, 1]",
                                    )
                                })?
                        }
                    };
                    let sleep_level = match fields.remove("sleep_level") {
                        None | Some(Value::Null) => None,
                        Some(v) => {
                            Some(v.as_u64().filter(|l| matches!(l, 1 | 2)).ok_or_else(|| {
                                Error::field(format!("{at}.sleep_level"), v, "use 1 or 2")
                            })? as u8)
                        }
                    };
                    Some(EngineSpec {
                        gpu_memory_utilization: util,
                        sleep_level,
                    })
                }
                Some(v) => {
                    return Err(Error::field(format!("{at}.engine"), v, "use vllm"));
                }
            };
            if engine.is_none() {
                for key in ["gpu_memory_utilization", "sleep_level"] {
                    if let Some(v) = fields.get(key) {
                        return Err(Error::field(
                            format!("{at}.{key}"),
                            v,
                            "it belongs to a rollout engine: add `engine: vllm`",
                        ));
                    }
                }
            }
            let home = match fields.remove("home") {
                None => Home::Gpu,
                Some(Value::String(h)) if h == "gpu" => Home::Gpu,
                Some(Value::String(h)) if h == "cpu" => Home::Cpu,
                Some(v) => return Err(Error::field(format!("{at}.home"), v, "use gpu or cpu")),
            };
            let spec = RunSpec::from_value(&Value::Object(fields)).map_err(|e| e.prefixed(&at))?;
            check_instance(&spec, home, &at)?;
            if engine.is_some()
                && (spec.parallel.is_some() || spec.lora.is_some() || home == Home::Cpu)
            {
                return Err(Error::Unsupported {
                    what: format!("{at}: a rollout engine with parallel, lora or home: cpu"),
                    supported: "one engine per GPU holding the whole model".into(),
                });
            }
            instances.push(InstanceSpec {
                name,
                at,
                spec,
                home,
                aliases: Vec::new(),
                engine,
            });
        }
        let find = |name: &str| {
            instances
                .iter()
                .position(|x| x.name == name || x.aliases.iter().any(|a| a == name))
        };
        let names: Vec<String> = instances
            .iter()
            .flat_map(|x| std::iter::once(x.name.clone()).chain(x.aliases.clone()))
            .collect();
        let unknown = |field: String, name: &str| {
            Error::field(
                field,
                name,
                format!("use an instance name: {}", names.join(", ")),
            )
        };
        let mut phases = Vec::new();
        for (i, item) in at_most(
            list("phases", "phases {name, run, offload}")?,
            "phases",
            limits::MAX_PHASES,
        )?
        .iter()
        .enumerate()
        {
            let at = format!("phases[{i}]");
            let p = item
                .as_object()
                .ok_or_else(|| Error::field(&at, item, "a mapping {name, run, offload}"))?;
            unknown_key(
                p,
                &format!("{at}."),
                &["name", "run", "offload"],
                "a phase key",
            )?;
            let name = p
                .get("name")
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty() && *n != "load")
                .ok_or_else(|| {
                    Error::field(
                        format!("{at}.name"),
                        p.get("name").cloned().unwrap_or(Value::Null),
                        "a name (not `load`, the building phase)",
                    )
                })?
                .to_string();
            let mut passes = Vec::new();
            let runs = p.get("run").and_then(Value::as_array).ok_or_else(|| {
                Error::field(
                    format!("{at}.run"),
                    p.get("run").cloned().unwrap_or(Value::Null),
                    "a list of instance names or {instance, pass, repeat}",
                )
            })?;
            for (j, run) in at_most(runs, &format!("{at}.run"), limits::MAX_PHASES)?
                .iter()
                .enumerate()
            {
                let at = format!("{at}.run[{j}]");
                let (name, pass, repeat) = match run {
                    Value::String(n) => (n.as_str(), None, 1),
                    Value::Object(r) => {
                        unknown_key(
                            r,
                            &format!("{at}."),
                            &["instance", "pass", "repeat", "new_tokens"],
                            "a key of a phase's run entry",
                        )?;
                        let new_tokens = r.get("new_tokens");
                        let pass = match r.get("pass") {
                            None => None,
                            Some(Value::String(s)) if s == "train" => Some(Pass::Train),
                            Some(Value::String(s)) if s == "forward" => Some(Pass::Forward),
                            Some(Value::String(s)) if s == "generate" => {
                                let n = new_tokens
                                    .and_then(Value::as_u64)
                                    .filter(|n| (1..=limits::MAX_NEW_TOKENS).contains(n));
                                let Some(new_tokens) = n else {
                                    return Err(Error::field(
                                        format!("{at}.new_tokens"),
                                        new_tokens.cloned().unwrap_or(Value::Null),
                                        format!(
                                            "a generate pass needs new_tokens, an integer from \
                                             1 to {} (real rollouts are up to 128k tokens)",
                                            limits::MAX_NEW_TOKENS
                                        ),
                                    ));
                                };
                                Some(Pass::Generate { new_tokens })
                            }
                            Some(v) => {
                                return Err(Error::field(
                                    format!("{at}.pass"),
                                    v,
                                    "use train, forward or generate",
                                ));
                            }
                        };
                        if new_tokens.is_some() && !matches!(pass, Some(Pass::Generate { .. })) {
                            return Err(Error::field(
                                format!("{at}.new_tokens"),
                                new_tokens.cloned().unwrap_or(Value::Null),
                                "new_tokens goes with pass: generate",
                            ));
                        }
                        let repeat = match r.get("repeat") {
                            None => 1,
                            Some(v) => {
                                v.as_u64()
                                    .filter(|&n| (1..=64).contains(&n))
                                    .ok_or_else(|| {
                                        Error::field(
                                            format!("{at}.repeat"),
                                            v,
                                            "use an integer from 1 to 64",
                                        )
                                    })? as u32
                            }
                        };
                        (
                            r.get("instance")
                                .and_then(Value::as_str)
                                .unwrap_or_default(),
                            pass,
                            repeat,
                        )
                    }
                    other => {
                        return Err(Error::field(at, other, "an instance name or a mapping"));
                    }
                };
                let instance = find(name).ok_or_else(|| unknown(at.clone(), name))?;
                let spec = &instances[instance].spec;
                let pass = pass.unwrap_or(match spec.mode {
                    Mode::Train => Pass::Train,
                    Mode::Forward => Pass::Forward,
                });
                if instances[instance].engine.is_some() && !matches!(pass, Pass::Generate { .. }) {
                    return Err(Error::field(
                        format!("{at}.pass"),
                        match pass {
                            Pass::Train => "train",
                            _ => "forward",
                        },
                        format!("{name} is a rollout engine: use pass: generate"),
                    ));
                }
                if pass == Pass::Train && spec.mode != Mode::Train {
                    return Err(Error::field(
                        format!("{at}.pass"),
                        "train",
                        format!("{name} is built for `mode: forward`; use pass: forward"),
                    ));
                }
                if let Pass::Generate { new_tokens } = pass
                    && new_tokens >= spec.seq_len
                {
                    return Err(Error::field(
                        format!("{at}.new_tokens"),
                        new_tokens,
                        format!(
                            "the prompt is seq_len - new_tokens: use fewer than {} (seq_len of {name})",
                            spec.seq_len
                        ),
                    ));
                }
                passes.push(PassDef {
                    instance,
                    pass,
                    repeat,
                });
            }
            let (mut offload, mut offload_optimizer) = (Vec::new(), Vec::new());
            let offloads = match p.get("offload").and_then(Value::as_array) {
                Some(items) => at_most(items, &format!("{at}.offload"), limits::MAX_PHASES)?,
                None => &[],
            };
            for (j, v) in offloads.iter().enumerate() {
                let oat = format!("{at}.offload[{j}]");
                let (name, params, optimizer) = match v {
                    Value::Object(o) => {
                        unknown_key(
                            o,
                            &format!("{oat}."),
                            &["instance", "params", "optimizer"],
                            "a key of an offload",
                        )?;
                        let flag = |key: &str, default: bool| match o.get(key) {
                            None => Ok(default),
                            Some(Value::Bool(b)) => Ok(*b),
                            Some(other) => Err(Error::field(
                                format!("{oat}.{key}"),
                                other,
                                "use true or false",
                            )),
                        };
                        let (params, optimizer) =
                            (flag("params", true)?, flag("optimizer", false)?);
                        if !params && !optimizer {
                            return Err(Error::field(
                                oat,
                                v,
                                "offload the parameters, the optimizer states or both",
                            ));
                        }
                        (
                            o.get("instance")
                                .and_then(Value::as_str)
                                .unwrap_or_default(),
                            params,
                            optimizer,
                        )
                    }
                    other => (other.as_str().unwrap_or_default(), true, false),
                };
                let i = find(name).ok_or_else(|| unknown(oat.clone(), name))?;
                if passes.iter().any(|x| x.instance == i) {
                    return Err(Error::field(
                        oat,
                        name,
                        "an instance the phase runs cannot be offloaded in it",
                    ));
                }
                if optimizer && instances[i].spec.mode != Mode::Train {
                    return Err(Error::field(
                        format!("{oat}.optimizer"),
                        true,
                        format!("{name} is not trained: it has no optimizer states"),
                    ));
                }
                if params {
                    offload.push(i);
                }
                if optimizer {
                    offload_optimizer.push(i);
                }
            }
            phases.push(PhaseDef {
                name,
                passes,
                offload,
                offload_optimizer,
            });
        }
        Ok(PipelineSpec {
            instances,
            phases,
            iterations: iterations(obj)?,
            versions: Versions::from_value(obj.get("versions"))?,
        })
    }

    /// `{policy, reference, placement, iterations}`: each iteration the reference's no-grad
    /// pass (`ref_logprob`), then one policy step (`train`).
    fn from_policy_reference(obj: &Map<String, Value>) -> Result<Self> {
        unknown_key(
            obj,
            "",
            &["policy", "reference", "placement", "iterations", "versions"],
            "a pipeline key",
        )?;
        let part = |key: &str| -> Result<RunSpec> {
            let v = obj.get(key).ok_or_else(|| {
                Error::field(
                    key,
                    "nothing",
                    "a run spec (model, precision, ...) is required",
                )
            })?;
            RunSpec::from_value(v).map_err(|e| e.prefixed(key))
        };
        let policy = part("policy")?;
        let mut reference = part("reference")?;
        check_instance(&policy, Home::Gpu, "policy")?;
        check_instance(&reference, Home::Gpu, "reference")?;
        reference.mode = Mode::Forward;
        reference.optimizer = Optimizer::None;
        if policy.mode != Mode::Train {
            return Err(Error::field(
                "policy.mode",
                "forward",
                "the policy trains: use train",
            ));
        }
        if (reference.batch_size, reference.seq_len) != (policy.batch_size, policy.seq_len) {
            return Err(Error::field(
                "reference.batch_size/seq_len",
                format!("{} x {}", reference.batch_size, reference.seq_len),
                format!(
                    "the reference scores the policy's batch: use {} x {}",
                    policy.batch_size, policy.seq_len
                ),
            ));
        }
        let (home, offload) = match obj.get("placement").and_then(Value::as_str) {
            None if obj.get("placement").is_none() => (Home::Gpu, vec![]),
            Some("resident") => (Home::Gpu, vec![]),
            Some("manual-offload") => (Home::Cpu, vec![0]),
            Some("fsdp2-offload") => {
                reference.parallel = Some(Parallel {
                    strategy: Strategy::Fsdp,
                    world_size: 1,
                    reshard_after_forward: true,
                    shard_size: 1,
                    offload_params: true,
                    offload_optimizer: false,
                    mixed_precision: None,
                    units: FsdpUnits::Layers,
                    tensor: TensorParallel::default(),
                    pipeline: Default::default(),
                    fsdp1: Fsdp1Options::default(),
                });
                (Home::Cpu, vec![])
            }
            _ => {
                return Err(Error::field(
                    "placement",
                    obj.get("placement").map_or(Value::Null, Value::clone),
                    "use resident, manual-offload or fsdp2-offload",
                ));
            }
        };
        for (name, spec, home) in [
            ("policy", &policy, Home::Gpu),
            ("reference", &reference, home),
        ] {
            check_instance(spec, home, name)?;
        }
        let instance = |name: &str, spec: RunSpec, home| InstanceSpec {
            name: name.into(),
            at: name.into(),
            spec,
            home,
            aliases: Vec::new(),
            engine: None,
        };
        Ok(PipelineSpec {
            instances: vec![
                instance("policy", policy, Home::Gpu),
                instance("reference", reference, home),
            ],
            phases: vec![
                PhaseDef {
                    name: "ref_logprob".into(),
                    passes: vec![PassDef {
                        instance: 1,
                        pass: Pass::Forward,
                        repeat: 1,
                    }],
                    offload,
                    offload_optimizer: vec![],
                },
                PhaseDef {
                    name: "train".into(),
                    passes: vec![PassDef {
                        instance: 0,
                        pass: Pass::Train,
                        repeat: 1,
                    }],
                    offload: vec![],
                    offload_optimizer: vec![],
                },
            ],
            iterations: iterations(obj)?,
            versions: Versions::from_value(obj.get("versions"))?,
        })
    }

    /// The simulated work of the pipeline within [`limits::MAX_PIPELINE_WORK`], given each
    /// instance's layers: over the iterations, each pass's repeats × layers × (4 to train, 1
    /// forward, 1 + new_tokens / 12 to generate). A rollout engine's passes cost nothing.
    pub fn check_work(&self, layers: &[u64]) -> Result<()> {
        let per_iteration = self
            .phases
            .iter()
            .flat_map(|p| &p.passes)
            .filter(|p| self.instances[p.instance].engine.is_none())
            .map(|p| {
                let per_layer = match p.pass {
                    Pass::Train => 4,
                    Pass::Forward => 1,
                    Pass::Generate { new_tokens } => 1 + new_tokens / 12,
                };
                u64::from(p.repeat)
                    .saturating_mul(layers.get(p.instance).copied().unwrap_or(0))
                    .saturating_mul(per_layer)
            })
            .fold(0u64, u64::saturating_add);
        let work = per_iteration.saturating_mul(u64::from(self.iterations));
        if work > limits::MAX_PIPELINE_WORK {
            return Err(Error::field(
                "iterations",
                self.iterations,
                format!(
                    "the pipeline would simulate {work} layer passes (repeats × layers × 4 to \
                     train, 1 forward, 1 + new_tokens / 12 to generate, per iteration), more \
                     than the {} an estimate may take; use fewer iterations, repeats or \
                     new_tokens: the peak settles within 3 iterations",
                    limits::MAX_PIPELINE_WORK
                ),
            ));
        }
        Ok(())
    }

    /// The instance that `name` (a name or an alias) refers to.
    pub fn instance(&self, name: &str) -> Option<&InstanceSpec> {
        self.instances
            .iter()
            .find(|x| x.name == name || x.aliases.iter().any(|a| a == name))
    }
}

/// `items`, unless it has more than `max` entries.
fn at_most<'a>(items: &'a [Value], field: &str, max: usize) -> Result<&'a [Value]> {
    if items.len() > max {
        return Err(Error::field(
            field,
            format!("a list of {}", items.len()),
            format!("use at most {max} entries (see `headroom::limits`)"),
        ));
    }
    Ok(items)
}

/// What an instance may be in a pipeline.
fn check_instance(spec: &RunSpec, home: Home, at: &str) -> Result<()> {
    if spec.trainer.kind != super::TrainerKind::Loop {
        return Err(Error::field(
            format!("{at}.trainer"),
            spec.trainer.kind.name(),
            "a pipeline's instances run the harness's passes (train, forward, generate); a \
             trainer is a run spec of its own (`headroom estimate` takes it directly)",
        ));
    }
    if home == Home::Cpu && spec.quantization.is_some() {
        return Err(Error::Unsupported {
            what: format!("{at}: a 4-bit model built on the host"),
            supported: "4-bit models loaded on the GPU (home: gpu)".into(),
        });
    }
    if spec.parallel.as_ref().is_some_and(|p| p.tensor.cp > 1) {
        // The passes of a pipeline's instances take their batch whole; context parallelism
        // shards it per step (measured in the harness's own loop).
        return Err(Error::Unsupported {
            what: format!("{at}.parallel.cp"),
            supported: "context parallelism in a run spec (`headroom estimate` takes it)".into(),
        });
    }
    if home == Home::Cpu
        && spec.parallel.as_ref().is_some_and(|p| {
            !(p.strategy == Strategy::Fsdp && p.world_size == 1 && p.offload_params)
        })
    {
        return Err(Error::Unsupported {
            what: format!("{at}: a sharded model built on the host"),
            supported: "home: gpu for ddp and fsdp (FSDP2 offload is `parallel.offload_params`)"
                .into(),
        });
    }
    Ok(())
}
