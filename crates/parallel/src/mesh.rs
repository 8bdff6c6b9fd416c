//! The device mesh: one description of the parallel degrees, checked once.
//!
//! "axis" is a mesh axis, "dim" a tensor dimension. Ranks are laid out row-major over the axes
//! in the order `pp, dp, ep, cp, tp`: `tp` varies fastest, so tensor-parallel peers (which talk
//! every layer) are neighbours — on one node — and pipeline stages (which talk least) are
//! farthest apart (Megatron-LM's and torchtitan's ordering).

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Axis {
    Pp,
    Dp,
    Ep,
    Cp,
    Tp,
}

pub const AXES: [Axis; 5] = [Axis::Pp, Axis::Dp, Axis::Ep, Axis::Cp, Axis::Tp];

impl fmt::Display for Axis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Axis::Pp => "pp",
            Axis::Dp => "dp",
            Axis::Ep => "ep",
            Axis::Cp => "cp",
            Axis::Tp => "tp",
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceMesh {
    /// Degree of each axis, in `AXES` order.
    sizes: [usize; 5],
}

impl DeviceMesh {
    /// Builds a mesh from `(axis, degree)` pairs (axes not named have degree 1) and checks
    /// that every degree is positive and their product equals `world`.
    pub fn new(degrees: &[(Axis, usize)], world: usize) -> Result<DeviceMesh, String> {
        let mut sizes = [1usize; 5];
        for &(axis, d) in degrees {
            if d == 0 {
                return Err(format!("parallel degree {axis} must be positive, got 0"));
            }
            sizes[AXES.iter().position(|a| *a == axis).unwrap()] = d;
        }
        let product: usize = sizes.iter().product();
        if product != world {
            let desc: Vec<String> = AXES.iter().zip(sizes).map(|(a, s)| format!("{a}={s}")).collect();
            return Err(format!("parallel degrees {} multiply to {product}, but the world size is {world}", desc.join(" × ")));
        }
        Ok(DeviceMesh { sizes })
    }

    /// The single-rank mesh.
    pub fn single() -> DeviceMesh {
        DeviceMesh { sizes: [1; 5] }
    }

    pub fn world(&self) -> usize {
        self.sizes.iter().product()
    }

    pub fn size(&self, axis: Axis) -> usize {
        self.sizes[Self::idx(axis)]
    }

    fn idx(axis: Axis) -> usize {
        AXES.iter().position(|a| *a == axis).unwrap()
    }

    /// Coordinates of `rank` on each axis, in `AXES` order.
    pub fn coords(&self, rank: usize) -> [usize; 5] {
        assert!(rank < self.world(), "rank {rank} outside world {}", self.world());
        let mut c = [0; 5];
        let mut r = rank;
        for i in (0..5).rev() {
            c[i] = r % self.sizes[i];
            r /= self.sizes[i];
        }
        c
    }

    pub fn rank(&self, coords: [usize; 5]) -> usize {
        coords.iter().zip(self.sizes).fold(0, |acc, (&c, s)| {
            assert!(c < s);
            acc * s + c
        })
    }

    /// The ranks that share every coordinate with `rank` except along `axes`, in rank order
    /// (row-major over those axes): the group of several axes at once, e.g. `[Dp, Ep]`, the
    /// ranks that split the batch under expert parallelism.
    pub fn group_axes(&self, axes: &[Axis], rank: usize) -> Vec<usize> {
        let mine = self.coords(rank);
        let free: Vec<usize> = axes.iter().map(|a| Self::idx(*a)).collect();
        (0..self.world())
            .filter(|&r| {
                let c = self.coords(r);
                (0..5).all(|i| free.contains(&i) || c[i] == mine[i])
            })
            .collect()
    }

    /// The ranks that share every coordinate with `rank` except along `axis`, in axis order:
    /// the communication group of `rank` for that axis.
    pub fn group(&self, axis: Axis, rank: usize) -> Vec<usize> {
        let i = Self::idx(axis);
        let mut c = self.coords(rank);
        (0..self.sizes[i])
            .map(|k| {
                c[i] = k;
                self.rank(c)
            })
            .collect()
    }
}
