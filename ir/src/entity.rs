//! Typed `u32` entity ids and the arenas that create them.
//!
//! Graph objects refer to each other by ids, never by references or bare `usize`: the ids are `Copy`,
//! four bytes, and cannot be confused with one another (a `NodeId` is not a `ValueId`). This is
//! cranelift's `cranelift-entity` pattern, kept small: `PrimaryMap` is the only thing that creates ids
//! (the text parser is the one exception, through `EntityRef::new`), and `SecondaryMap` holds side
//! tables keyed by ids, with a default for ids it has not seen.

use std::marker::PhantomData;

/// A typed index into a `PrimaryMap`.
pub trait EntityRef: Copy + Eq {
    /// Builds the id of index `index`. Only arenas and the text parser call this.
    fn new(index: usize) -> Self;
    /// The index this id stands for.
    fn index(self) -> usize;
}

/// Implements `EntityRef`, `Display` and `Debug` for a `u32` newtype; both print `prefix` then the number.
#[macro_export]
macro_rules! entity_impl {
    ($entity:ident, $prefix:expr) => {
        impl $crate::entity::EntityRef for $entity {
            fn new(index: usize) -> Self {
                $entity(u32::try_from(index).expect("entity index overflows u32"))
            }
            fn index(self) -> usize {
                self.0 as usize
            }
        }
        impl std::fmt::Display for $entity {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{}{}", $prefix, self.0)
            }
        }
        impl std::fmt::Debug for $entity {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                std::fmt::Display::fmt(self, f)
            }
        }
        impl $entity {
            /// The number in this id's text spelling.
            pub fn as_u32(self) -> u32 {
                self.0
            }
        }
    };
}

/// The arena that owns entities of type `V` and hands out their ids, in creation order.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PrimaryMap<K, V> {
    elems: Vec<V>,
    #[serde(skip)]
    unused: PhantomData<K>,
}

impl<K: EntityRef, V> PrimaryMap<K, V> {
    /// An empty arena.
    pub fn new() -> Self {
        Self { elems: Vec::new(), unused: PhantomData }
    }
    /// Stores `value` and returns its new id.
    pub fn push(&mut self, value: V) -> K {
        let id = K::new(self.elems.len());
        self.elems.push(value);
        id
    }
    /// The number of entities.
    pub fn len(&self) -> usize {
        self.elems.len()
    }
    /// Whether the arena is empty.
    pub fn is_empty(&self) -> bool {
        self.elems.is_empty()
    }
    /// The entity `id`, if it exists.
    pub fn get(&self, id: K) -> Option<&V> {
        self.elems.get(id.index())
    }
    /// Whether `id` names an entity of this arena.
    pub fn is_valid(&self, id: K) -> bool {
        id.index() < self.elems.len()
    }
    /// Every id, in creation order.
    pub fn keys(&self) -> impl Iterator<Item = K> + '_ {
        (0..self.elems.len()).map(K::new)
    }
    /// Every (id, entity), in creation order.
    pub fn iter(&self) -> impl Iterator<Item = (K, &V)> + '_ {
        self.elems.iter().enumerate().map(|(index, value)| (K::new(index), value))
    }
}

impl<K: EntityRef, V> Default for PrimaryMap<K, V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: EntityRef, V> std::ops::Index<K> for PrimaryMap<K, V> {
    type Output = V;
    fn index(&self, id: K) -> &V {
        &self.elems[id.index()]
    }
}

impl<K: EntityRef, V> std::ops::IndexMut<K> for PrimaryMap<K, V> {
    fn index_mut(&mut self, id: K) -> &mut V {
        &mut self.elems[id.index()]
    }
}

impl<K, V: std::fmt::Debug> std::fmt::Debug for PrimaryMap<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.elems.iter()).finish()
    }
}

/// A side table keyed by ids of another arena; ids it has not stored read as the default.
#[derive(Clone, Debug)]
pub struct SecondaryMap<K, V: Clone> {
    elems: Vec<V>,
    default: V,
    unused: PhantomData<K>,
}

impl<K: EntityRef, V: Clone + Default> SecondaryMap<K, V> {
    /// An empty table whose default is `V::default()`.
    pub fn new() -> Self {
        Self::with_default(V::default())
    }
}

impl<K: EntityRef, V: Clone + Default> Default for SecondaryMap<K, V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: EntityRef, V: Clone> SecondaryMap<K, V> {
    /// An empty table with the given default.
    pub fn with_default(default: V) -> Self {
        Self { elems: Vec::new(), default, unused: PhantomData }
    }
    /// Sets the entry of `id`.
    pub fn insert(&mut self, id: K, value: V) {
        if id.index() >= self.elems.len() {
            self.elems.resize(id.index() + 1, self.default.clone());
        }
        self.elems[id.index()] = value;
    }
}

impl<K: EntityRef, V: Clone> std::ops::Index<K> for SecondaryMap<K, V> {
    type Output = V;
    fn index(&self, id: K) -> &V {
        self.elems.get(id.index()).unwrap_or(&self.default)
    }
}

impl<K: EntityRef, V: Clone> std::ops::IndexMut<K> for SecondaryMap<K, V> {
    fn index_mut(&mut self, id: K) -> &mut V {
        if id.index() >= self.elems.len() {
            self.elems.resize(id.index() + 1, self.default.clone());
        }
        &mut self.elems[id.index()]
    }
}
