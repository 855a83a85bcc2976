//! The `gateway` binary: everything is in the library ([`gateway::app`]).

fn main() -> anyhow::Result<()> {
    gateway::app::run()
}
