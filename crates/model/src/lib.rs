//! kiln's models: configs, the named flat parameter layout, and the GPT-2 decoder with its
//! forward, backward and KV-cached generation. Nothing here knows about ranks: parallel
//! strategies act on the layout by parameter name, from the `parallel` crate, and tell a part
//! of the model where it sits through its [`Placement`].

pub mod config;
#[cfg(feature = "device")]
pub mod device;
pub mod generate;
pub mod hf;
pub mod gpt;
pub mod layout;
pub mod pairs;
pub mod lora;
pub mod mla;
pub mod placement;
pub mod policy;
pub mod qbase;
pub mod units;

pub use config::GptConfig;
pub use generate::{Sampler, KvCache};
pub use gpt::{BaseQuant, Docs, Gpt, Pass, Precision, Recompute};
pub use layout::{ParamLayout, ParamSpec, Init};
pub use placement::Placement;
pub use units::{Access, CpHooks, HeadsBackward, HeadsForward, Local, TpHooks, UnitStore};
